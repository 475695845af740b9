"""`pdplane plan`: how many prefill and decode instances meet an SLO on a workload.

    pdplane plan --profile llama3-8b-h100 --workload seed-long-output \
        --slo 'ttft_p90<=2s,itl_p90<=50ms' [--gpus 8] [--rate 10] [--json]

Simulates candidate XpYd fleets on the profile's engine model in modelled time (no real time
passes) and prints the recommendation, its neighbours and the plain alternative
(docs/plan.md). Exit codes: 0 a recommendation, 1 the SLO cannot be met, 2 bad flags.

    pdplane plan --registry HOST:PORT --window 10m [--gateway URL] [--serve-metrics PORT]

Live advice: reads the registry's load reports (and the gateway's TTFT/TPOT) over the window
and says which side is the bottleneck; with --serve-metrics it keeps going and exports the
verdict as Prometheus gauges. Exit code 1 when the registry cannot be reached.

The `pdplane` command runs this through `pdplane.cli.plan`, which gives `main` the local
`pdplane up` fleet's credentials as the registry token's default (`token_for`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import grpc
from pydantic import Field

from pdplane.core.settings import CommandSettings
from pdplane.core.token_file import token_file_field
from pdplane.plan.live_cli import parse_duration, run_live
from pdplane.plan.report import plan_json, plan_text, verify_text
from pdplane.plan.search import parse_slo, plan_fleet, window
from pdplane.plan.workload import SHAPES, RequestSpec, Shape, load_workload
from pdplane.sim.profiles import PROFILES, load_profile

__all__ = ["PlanSettings", "TokenFor", "main", "window"]

#: (registry address, the --token flag or None) -> the bearer token to send, or None.
TokenFor = Callable[[str, str | None], str | None]


class PlanSettings(CommandSettings):
    """Flags of `pdplane plan` (each also a `PDPLANE_*` environment variable)."""

    profile: str = Field(
        "llama3-8b-h100",
        description=f"engine profile: built in {', '.join(PROFILES)}; or a JSON file "
        "(`pdplane profile` measures one)",
    )
    workload: str = Field(
        "seed-long-output",
        description=f"built in {', '.join(SHAPES)}; or poisson:isl=N,osl=N,rate=R[,cv=C], or "
        "a JSONL trace",
    )
    slo: str = Field("ttft_p90<=2s,itl_p90<=50ms", description="latency targets")
    gpus: int = Field(0, ge=0, description="GPU budget (one instance = one GPU); 0 = no limit")
    max_prefill: int = Field(32, ge=1, description="most prefill instances to consider")
    max_decode: int = Field(32, ge=1, description="most decode instances to consider")
    rate: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="request rate (req/s); 0 = the workload's"
    )
    duration_s: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="simulated traffic (s); 0 = one request lifetime + max(half, 60 s)",
    )
    decode_max_num_seqs: int | None = Field(None, ge=1, description="decode --max-num-seqs")
    kv_limit: float = Field(
        0.9, gt=0, le=1, description="most mean KV cache usage a fleet may run at (headroom)"
    )
    seed: int = Field(0, description="workload seed")
    verify: bool = Field(
        False,
        description="re-run the recommendation and its neighbours on a fresh seed, 2x longer",
    )
    json_out: bool = Field(False, alias="json", description="print JSON instead of Markdown")
    # live advice
    registry: str | None = Field(
        None, description="live advice: registry host:port (several comma-separated)"
    )
    token: str | None = Field(
        None,
        description="registry bearer token (default: the local `pdplane up` fleet's, if this "
        "is its registry)",
    )
    token_file: str | None = token_file_field("--token")
    tls_ca: str | None = Field(None, description="CA certificate (PEM) to verify registry TLS")
    window: str = Field("10m", description="live advice: sliding window (10m, 30s, ...)")
    interval_s: float = Field(1.0, gt=0, description="live advice: sampling period (s)")
    gateway: str | None = Field(
        None, description="live advice: gateway base URL (its /metrics give TTFT/TPOT)"
    )
    serve_metrics: int | None = Field(
        None, ge=0, le=65535, description="live advice: keep going, export gauges on this port"
    )


def _live(s: PlanSettings, token_for: TokenFor | None) -> int:
    try:
        window_s = parse_duration(s.window)
        slo = parse_slo(s.slo)
    except ValueError as exc:
        sys.stderr.write(f"error: pdplane plan: {exc}\n")
        return 2
    registry = s.registry or ""
    gateway = f" and the gateway's TTFT/TPOT from {s.gateway}" if s.gateway else ""
    # One window of real time passes before the verdict: say so rather than wait in silence.
    sys.stderr.write(f"collecting {s.window} of load reports from {registry}{gateway}\n")
    sys.stderr.flush()
    try:
        run_live(
            registry,
            window_s=window_s,
            interval_s=s.interval_s,
            gateway=s.gateway,
            token=token_for(registry, s.token) if token_for else (s.token or None),
            tls_ca=s.tls_ca,
            ttft_slo_s=slo.bound("ttft"),
            itl_slo_s=slo.bound("itl"),
            serve_metrics=s.serve_metrics,
            json_out=s.json_out,
        )
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "ERROR"
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        sys.stderr.write(f"pdplane plan: registry: {code}: {details}\n")
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def main(argv: list[str], *, token_for: TokenFor | None = None) -> int:
    """Runs `pdplane plan`; see the module docstring for exit codes.

    `token_for` picks live advice's registry token from the address and the --token flag
    (None: the flag as given).
    """
    s = PlanSettings.parse(argv, prog="pdplane plan")
    if s.registry:
        return _live(s, token_for)
    try:
        profile = load_profile(s.profile)
        slo = parse_slo(s.slo, s.kv_limit)
        wl = load_workload(s.workload)
    except ValueError as exc:
        sys.stderr.write(f"error: pdplane plan: {exc}\n")
        return 2
    if isinstance(wl, Shape):
        duration, warmup = window(wl, slo, s.duration_s)
        rate = s.rate or wl.rate
        requests: list[RequestSpec] = wl.requests(duration, rate=rate, seed=s.seed)
    else:
        requests = wl
        span = max(requests[-1].at, 1e-9)
        rate, warmup = len(requests) / span, span / 4
    try:
        plan = plan_fleet(
            profile,
            requests,
            slo,
            gpus=s.gpus,
            max_prefill=s.max_prefill,
            max_decode=s.max_decode,
            warmup_s=warmup,
            decode_max_num_seqs=s.decode_max_num_seqs,
        )
    except ValueError as exc:
        sys.stderr.write(f"error: pdplane plan: {exc}\n")
        return 2
    if s.json_out:
        sys.stdout.write(json.dumps(plan_json(plan, profile), indent=1) + "\n")
    else:
        sys.stdout.write(plan_text(plan, profile, s.workload, rate))
    if s.verify and plan.best is not None and isinstance(wl, Shape):
        again = wl.requests(2 * duration, rate=rate, seed=s.seed + 1)
        sys.stdout.write(verify_text(plan, profile, again, warmup))
    return 0 if plan.best is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
