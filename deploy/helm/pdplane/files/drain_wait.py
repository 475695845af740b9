#!/usr/bin/env python3
"""preStop hook of a vLLM instance pod: drain it, then wait until it has nothing left to do.

Kubernetes runs this before it sends SIGTERM to vLLM (scale-in, rollout, node drain):

1. `pdplane drain` marks the instance DRAINING in the registry: the schedulers stop sending it
   new requests (they see the change on their watch within milliseconds);
2. for `PDPLANE_DRAIN_SETTLE_S` seconds requests the schedulers picked just before still arrive,
   so an idle instance does not count yet;
3. then it waits until the registry's load report of the instance shows no running or waiting
   request and no KV transfer in flight (a prefill holds KV blocks until decode has pulled
   them), twice in a row one heartbeat apart; when the registry cannot be reached it reads the
   same from vLLM's own `/metrics` (`vllm:num_requests_running`, `vllm:num_requests_waiting`).

It never waits longer than `PDPLANE_DRAIN_TIMEOUT_S` (keep it below the pod's
terminationGracePeriodSeconds) and always exits 0: a hook that fails would only make Kubernetes
log an event and kill the container anyway.

Environment (the pod sets it): PDPLANE_INSTANCE_ID, PDPLANE_REGISTRY, PDPLANE_TOKEN,
PDPLANE_TLS_CA (as for `pdplane drain`), PDPLANE_DRAIN_TIMEOUT_S (default 600),
PDPLANE_DRAIN_SETTLE_S (default 3), PDPLANE_DRAIN_POLL_S (default 1), PDPLANE_DRAIN_METRICS_URL
(default http://127.0.0.1:8100/metrics).
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdplane.cli import drain
from pdplane.core.grpc import util as grpc_util
from pdplane.v1 import registry_pb2, registry_pb2_grpc

__all__ = ["Busy", "main", "registry_busy", "vllm_busy", "wait_idle"]

_VLLM_BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class Busy:
    """What an instance still has to do: requests and KV transfers (counts); `gone` when the
    registry no longer lists it (it deregistered: nothing left)."""

    requests: int
    transfers: int
    gone: bool = False

    @property
    def idle(self) -> bool:
        return self.gone or (self.requests == 0 and self.transfers == 0)


def registry_busy(registry: str, instance_id: str, token: str | None, tls_ca: str | None) -> Busy:
    """The registry's view of `instance_id`. Raises grpc.RpcError when the registry cannot be
    asked (unreachable, refused)."""
    with grpc_util.channel(registry, tls_ca) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        try:
            inst = stub.GetInstance(
                registry_pb2.GetInstanceRequest(instance_id=instance_id),
                timeout=3.0,
                metadata=grpc_util.token_metadata(token),
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return Busy(0, 0, gone=True)
            raise
    load = inst.load
    return Busy(load.num_running + load.num_waiting, load.inflight_transfers)


def vllm_busy(metrics_url: str) -> Busy:
    """Running + waiting requests from vLLM's Prometheus text (summed over its label sets;
    KV transfers are not visible there). Raises OSError when vLLM does not answer."""
    with urllib.request.urlopen(metrics_url, timeout=3.0) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name in _VLLM_BUSY:
            total += sum(s.value for s in family.samples)
    return Busy(int(total), 0)


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def wait_idle(
    instance_id: str,
    registry: str,
    *,
    token: str | None,
    tls_ca: str | None,
    metrics_url: str,
    timeout_s: float,
    settle_s: float,
    poll_s: float,
) -> bool:
    """Polls until the instance is idle twice in a row after `settle_s`; returns whether it
    got idle within `timeout_s` (seconds, from the call)."""
    start = time.monotonic()
    idle_reads = 0
    while time.monotonic() - start < timeout_s:
        try:
            busy = registry_busy(registry, instance_id, token, tls_ca)
        except grpc.RpcError as exc:
            try:
                busy = vllm_busy(metrics_url)
            except OSError:
                _log(f"registry {exc.code().name} and vLLM metrics unreachable; waiting")
                busy = Busy(1, 0)
        if busy.gone:
            return True
        settled = time.monotonic() - start >= settle_s
        idle_reads = idle_reads + 1 if busy.idle and settled else 0
        if idle_reads >= 2:
            return True
        time.sleep(poll_s)
    return False


def _log(message: str) -> None:
    sys.stderr.write(f"pdplane drain-wait: {message}\n")
    sys.stderr.flush()


def main() -> int:
    """Drains `PDPLANE_INSTANCE_ID` and waits (see the module docstring); returns 0."""
    instance_id = os.environ.get("PDPLANE_INSTANCE_ID", "")
    if not instance_id:
        _log("PDPLANE_INSTANCE_ID is not set; nothing to drain")
        return 0
    start = time.monotonic()
    # Reads the same PDPLANE_* variables; prints "<id>: draining".
    if drain.main([]) != 0:
        _log("drain call failed; waiting for running requests anyway")
    done = wait_idle(
        instance_id,
        os.environ.get("PDPLANE_REGISTRY", "127.0.0.1:8051"),
        token=os.environ.get("PDPLANE_TOKEN") or None,
        tls_ca=os.environ.get("PDPLANE_TLS_CA") or None,
        metrics_url=os.environ.get("PDPLANE_DRAIN_METRICS_URL", "http://127.0.0.1:8100/metrics"),
        timeout_s=_env_float("PDPLANE_DRAIN_TIMEOUT_S", 600.0),
        settle_s=_env_float("PDPLANE_DRAIN_SETTLE_S", 3.0),
        poll_s=_env_float("PDPLANE_DRAIN_POLL_S", 1.0),
    )
    elapsed = time.monotonic() - start
    _log(f"{instance_id}: {'idle' if done else 'still busy, giving up'} after {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
