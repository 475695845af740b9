"""`pdplane autoscale`: the controller as its own process, acting on Kubernetes workloads.

    pdplane autoscale --registry HOST:PORT --model NAME --gateway http://GW:8000 \
        --prefill-workload deployment/pd-pdplane-prefill \
        --decode-workload deployment/pd-pdplane-decode [--namespace NS] \
        [--etcd-endpoints host:2379,...] [--metrics-port 9402] [controller flags]

What the Helm chart runs when `autoscaler.enabled` is set (docs/autoscale.md). Every
`--autoscale-interval-s` it reads the registry, the instances' `/metrics` and the gateway's
histograms, decides, and patches the workloads' replicas (`pdplane.autoscale.kubernetes`).
With `--etcd-endpoints` only the holder of the leader lease acts; without, it acts alone.
Exit codes: 0 on SIGTERM/SIGINT, 2 on bad flags.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

import grpc
from prometheus_client import start_http_server
from pydantic import Field

from pdplane.autoscale.kubernetes import KubernetesActuator, apps_api, parse_workload
from pdplane.autoscale.leader import EtcdLeader
from pdplane.autoscale.loop import AutoscaleMetrics, Autoscaler
from pdplane.autoscale.scrape import FleetScraper
from pdplane.autoscale.settings import AutoscaleOptions
from pdplane.core.settings import LogLevel
from pdplane.core.token_file import token_file_field
from pdplane.registry.etcd.client import parse_endpoints

__all__ = ["AutoscaleSettings", "main"]

log = logging.getLogger("pdplane.autoscale")


class AutoscaleSettings(AutoscaleOptions):
    """`pdplane autoscale` flags (each also a `PDPLANE_*` environment variable)."""

    registry: str = Field("127.0.0.1:8051", description="registry host:port (comma-separated)")
    token: str | None = Field(None, description="registry bearer token")
    token_file: str | None = token_file_field("--token")
    tls_ca: str | None = Field(None, description="CA certificate (PEM) to verify registry TLS")
    model: str = Field(..., description="served model name whose fleet this controller sizes")
    gateway: str | None = Field(None, description="gateway base URL (TTFT/TPOT from /metrics)")
    namespace: str = Field("default", description="namespace of the workloads")
    prefill_workload: str = Field(..., description="deployment/NAME or statefulset/NAME")
    decode_workload: str = Field(..., description="deployment/NAME or statefulset/NAME")
    kube_api: str | None = Field(
        None, description="Kubernetes API URL without credentials (default: in-cluster config)"
    )
    etcd_endpoints: str = Field(
        "", description="etcd endpoints for the leader lease ('' = act alone: one replica)"
    )
    etcd_prefix: str = Field("/pdplane/", description="etcd key prefix (the registry's)")
    etcd_ca: str | None = Field(None, description="CA certificate (PEM) to verify etcd's TLS")
    etcd_cert: str | None = Field(None, description="client certificate (PEM) for etcd")
    etcd_key: str | None = Field(None, description="client private key (PEM) for etcd")
    metrics_port: int = Field(9402, ge=0, le=65535, description="Prometheus /metrics; 0 = off")
    log_level: LogLevel = Field("INFO", description="Python logging level")


def main(argv: list[str]) -> int:
    """Runs `pdplane autoscale` until SIGTERM/SIGINT; see the module docstring."""
    s = AutoscaleSettings.parse(argv)
    logging.basicConfig(level=s.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        workloads = {
            "prefill": parse_workload(s.prefill_workload, s.namespace),
            "decode": parse_workload(s.decode_workload, s.namespace),
        }
        controller = s.controller("llama3-8b-h100")
        api = apps_api(s.kube_api)
    except ValueError as exc:
        sys.stderr.write(f"error: pdplane autoscale: {exc}\n")
        return 2
    actuator = KubernetesActuator(api, workloads)
    scraper = FleetScraper(
        s.registry,
        window_s=s.autoscale_window_s,
        model=s.model,
        token=s.token,
        tls_ca=s.tls_ca,
        gateway=s.gateway,
    )
    leader = None
    if s.etcd_endpoints:
        leader = EtcdLeader(
            parse_endpoints(s.etcd_endpoints),
            f"{s.etcd_prefix}autoscale/{s.model}/leader",
            ttl_s=max(10, int(3 * s.autoscale_interval_s)),
            ca=s.etcd_ca,
            cert=s.etcd_cert,
            cert_key=s.etcd_key,
        )
    metrics = AutoscaleMetrics()
    if s.metrics_port:
        start_http_server(s.metrics_port, registry=metrics.registry)
    autoscaler = Autoscaler(
        controller,
        scraper,
        actuator,
        metrics=metrics,
        is_leader=leader.is_leader if leader else lambda: True,
        say=log.info,
    )
    stop = threading.Event()

    def _stop(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("autoscale: %s, workloads %s", s.model, ", ".join(str(w) for w in workloads.values()))
    try:
        while not stop.wait(s.autoscale_interval_s):
            try:
                autoscaler.step()
            except grpc.RpcError as exc:
                code = exc.code().name if isinstance(exc, grpc.Call) else "ERROR"
                hint = (
                    " (give the registry's token: --token-file or PDPLANE_TOKEN)"
                    if code == "UNAUTHENTICATED"
                    else ""
                )
                log.warning("autoscale: registry %s%s; step skipped", code, hint)
            except Exception as exc:  # the Kubernetes API refused or failed: next step retries
                log.warning("autoscale: step failed: %s: %s", type(exc).__name__, str(exc)[:300])
    finally:
        scraper.close()
        if leader is not None:
            leader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
