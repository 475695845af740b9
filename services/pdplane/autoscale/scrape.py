"""Reads a running fleet for the controller: the registry's list (roles, states, load
reports), each serving instance's Prometheus `/metrics` (vLLM's request and token counters),
and optionally the gateway's TTFT / TPOT histograms and the model's demand the instances do
not see, into `Observation`s.

The gateway's flow control holds requests past the model's in-flight budget and sheds them
under overload (docs/flow-control.md), so in an overload the instances' queues stop growing
while the demand still does. `gateway_demand` reads that part from the gateway's page:
requests waiting for their turn (`pdplane_gateway_flow_queued_requests`) and those that
left without reaching an instance (`pdplane_gateway_flow_shed_total`: 429, and
`pdplane_gateway_flow_timeouts_total`: every wait that timed out, 429 or 503), for the
model; the observation counts them as arrivals (`pdplane.autoscale.observe`, role
"gateway").

vLLM (and `pdplane sim`) count on `/metrics`: `vllm:request_success_total` (finished
requests, by finish reason), `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`;
the sums over their label sets are what `pdplane.autoscale.observe` needs. An instance whose
`/metrics` does not answer is left out of that sample (its load still counts).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdplane.autoscale.observe import GATEWAY, InstanceSample, Observation, TrafficWindow
from pdplane.core.grpc import util as grpc_util
from pdplane.plan.live_cli import GatewayWindow
from pdplane.registry.failover import RegistryEndpoints, call_any
from pdplane.v1 import instance_pb2, registry_pb2

__all__ = ["FleetScraper", "counters", "gateway_demand", "role_of"]

_COUNTERS = {
    "vllm:request_success": "finished",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
}


_WAITING = "pdplane_gateway_flow_queued_requests"
_LEFT = ("pdplane_gateway_flow_shed", "pdplane_gateway_flow_timeouts")


def gateway_demand(text: str, model: str | None) -> InstanceSample:
    """The gateway's part of `model`'s demand (None: every model) from its `/metrics` page:
    a sample of role "gateway" whose `waiting` is the requests waiting for their turn now
    and `finished` the requests shed or timed out there so far (counters; module
    docstring). Raises ValueError on text that is not Prometheus' format."""
    waiting = left = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != _WAITING and family.name not in _LEFT:
            continue
        for s in family.samples:
            if model is not None and s.labels.get("model") != model:
                continue
            if family.name == _WAITING:
                waiting += s.value
            elif s.name.endswith("_total") and s.labels.get("reason") != "timeout":
                # A timeout answered 429 is in both counters: once, from flow_timeouts.
                left += s.value
    return InstanceSample("gateway", left, 0.0, 0.0, waiting=waiting)


def role_of(inst: instance_pb2.Instance) -> str:
    """'prefill' | 'decode' | 'both' of a listed instance."""
    return instance_pb2.Role.Name(inst.spec.role).removeprefix("ROLE_").lower()


def counters(text: str) -> dict[str, float]:
    """finished / prompt_tokens / generation_tokens from a Prometheus text page (0 when a
    family is absent). Raises ValueError on text that is not Prometheus' format."""
    out = dict.fromkeys(_COUNTERS.values(), 0.0)
    for family in text_string_to_metric_families(text):
        key = _COUNTERS.get(family.name)
        if key is None:
            continue
        out[key] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


class FleetScraper:
    """One model's fleet (`model`; None = every instance) seen through the registry at
    `registry` and the instances' `/metrics`, over a `window_s` sliding window."""

    def __init__(
        self,
        registry: str,
        *,
        window_s: float,
        model: str | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        gateway: str | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        self.endpoints = RegistryEndpoints(registry, tls_ca)
        self.metadata = grpc_util.token_metadata(token)
        self.model = model
        self.window = TrafficWindow(window_s)
        self.gateway = GatewayWindow(gateway, window_s) if gateway else None
        self.timeout_s = timeout_s
        self._http = httpx.Client(timeout=timeout_s)

    def list_instances(self) -> list[instance_pb2.Instance]:
        """The registry's instances of the model. Raises grpc.RpcError when it cannot be
        asked."""
        reply = call_any(
            self.endpoints,
            lambda stub: stub.ListInstances(
                registry_pb2.ListInstancesRequest(),
                timeout=self.timeout_s,
                metadata=self.metadata,
            ),
        )
        return [i for i in reply.instances if self.model is None or i.spec.model == self.model]

    def _sample(self, inst: instance_pb2.Instance) -> InstanceSample | None:
        try:
            page = self._http.get(f"{inst.spec.url.rstrip('/')}/metrics")
            page.raise_for_status()
            c = counters(page.text)
        except (httpx.HTTPError, ValueError):
            return None
        load = inst.load
        return InstanceSample(
            role_of(inst),
            c["finished"],
            c["prompt_tokens"],
            c["generation_tokens"],
            load.num_running,
            load.num_waiting,
            load.kv_cache_usage,
        )

    def observe(
        self, instances: Sequence[instance_pb2.Instance], now: float | None = None
    ) -> Observation:
        """Samples `instances` (a `list_instances` answer) at `now` (monotonic s) and returns
        the window's observation."""
        t = time.monotonic() if now is None else now
        samples = {}
        for inst in instances:
            if role_of(inst) not in ("prefill", "decode"):
                continue
            s = self._sample(inst)
            if s is not None:
                samples[inst.spec.instance_id] = s
        ttft = itl = math.nan
        if self.gateway is not None:
            page = self.gateway.scrape(t)
            if page is not None:  # parsed once already by the scrape
                samples[GATEWAY] = gateway_demand(page, self.model)
            ttft = self.gateway.p90("pdplane_gateway_ttft_seconds")
            itl = self.gateway.p90("pdplane_gateway_tpot_seconds")
        self.window.add(t, samples)
        return self.window.observation(ttft, itl)

    def close(self) -> None:
        self._http.close()
        self.endpoints.close()
