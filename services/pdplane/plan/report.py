"""Text and JSON renderings of a `Plan` (what `pdplane plan` prints)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdplane.plan.fleetsim import FleetResult, simulate_fleet
from pdplane.plan.search import Plan
from pdplane.plan.workload import RequestSpec
from pdplane.sim.profiles import Profile

__all__ = ["plan_json", "plan_text", "recommended_flags", "verify_text"]


def recommended_flags(profile: Profile, r: FleetResult) -> dict[str, dict[str, int]]:
    """Per-role engine flags: the profile's limits, and for decode a push receive buffer of
    1.25 x the peak KV bytes that waited for a pull on one decode (what push mode would have
    had to hold), at least one max-length prompt's KV."""
    out = {
        "prefill": {
            "max_num_seqs": r.config.prefill_max_num_seqs or profile.max_num_seqs,
            "max_num_batched_tokens": r.config.prefill_max_num_batched_tokens
            or profile.max_num_batched_tokens,
        },
        "decode": {
            "max_num_seqs": r.config.decode_max_num_seqs or profile.max_num_seqs,
            "max_num_batched_tokens": r.config.decode_max_num_batched_tokens
            or profile.max_num_batched_tokens,
        },
    }
    dec = r.roles.get("decode")
    if dec is not None:
        floor = profile.max_model_len * profile.kv_bytes_per_token
        out["decode"]["push_buffer_bytes"] = max(int(dec.peak_loading_bytes * 1.25), floor)
    return out


def _row(plan: Plan, r: FleetResult, what: str) -> str:
    ok = "meets" if plan.slo.met(r) else "FAILS"
    if plan.slo.latency_met(r) and not plan.slo.kv_ok(r):
        ok = f"FAILS (KV > {plan.slo.kv_limit:.0%})"
    roles = "; ".join(
        f"{k} util {v.utilisation:.0%} run {v.mean_running:.0f} kv {v.mean_kv_usage:.0%}"
        + (f" preempt {v.preemptions}" if v.preemptions else "")
        for k, v in r.roles.items()
    )
    return (
        f"| {what} | {r.config.label} | {r.config.instances} | {ok} | "
        f"{r.ttft_q(0.5):.3f} / {r.ttft_q(0.9):.3f} / {r.ttft_q(0.99):.3f} | "
        f"{r.itl_q(0.5) * 1e3:.1f} / {r.itl_q(0.9) * 1e3:.1f} / {r.itl_q(0.99) * 1e3:.1f} | "
        f"{r.goodput:.2f} | {roles} |"
    )


def plan_text(plan: Plan, profile: Profile, workload: str, rate: float) -> str:
    """A Markdown report: recommendation, neighbours, plain alternatives, verdict."""
    lines = [
        f"profile {profile.name}, workload {workload} at {rate:g} req/s, SLO {plan.slo}",
        f"closed-form estimate {plan.estimate[0]}P{plan.estimate[1]}D; "
        f"{len(plan.runs)} fleets simulated in {plan.seconds:.1f} s of CPU",
        "",
        "| fleet | XpYd | GPUs | SLO | TTFT p50/p90/p99 s | ITL p50/p90/p99 ms | goodput req/s "
        "| per role |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows: list[tuple[str, FleetResult | None]] = [("recommended", plan.best)]
    rows += [("neighbour", n) for n in plan.neighbours]
    rows += [("plain, same GPUs", plan.plain_same), ("plain, fewest meeting", plan.plain_min)]
    seen = set()
    for what, r in rows:
        if r is None or r.config in seen:
            continue
        seen.add(r.config)
        lines.append(_row(plan, r, what))
    lines.append("")
    if plan.best is None:
        lines.append(f"verdict: {plan.reason}")
    else:
        b = plan.best
        flags = recommended_flags(profile, b)
        lines.append(
            f"recommendation: {b.config.prefill} prefill + {b.config.decode} decode instances"
        )
        for role, f in flags.items():
            shown = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in f.items())
            lines.append(f"  {role}: {shown}")
        pm = plan.plain_min
        if pm is not None and pm.config.instances < b.config.instances:
            lines.append(
                f"verdict: disaggregation does not pay here: {pm.config.plain} plain instances "
                f"meet the SLO with {b.config.instances - pm.config.instances} GPU(s) fewer "
                f"than {b.config.label}"
            )
        elif pm is not None and pm.config.instances == b.config.instances:
            lines.append(
                f"verdict: disaggregation does not pay here: {pm.config.plain} plain instances "
                f"meet the SLO on the same GPUs as {b.config.label}"
            )
        elif pm is None:
            lines.append(
                "verdict: disaggregation pays: no plain fleet within the budget meets the SLO"
            )
        else:
            lines.append(
                f"verdict: disaggregation pays: plain needs {pm.config.plain} instances, "
                f"{b.config.label} needs {b.config.instances}"
            )
    return "\n".join(lines) + "\n"


def _result_json(plan: Plan, r: FleetResult | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "fleet": r.config.label,
        "prefill": r.config.prefill,
        "decode": r.config.decode,
        "plain": r.config.plain,
        "meets_slo": plan.slo.met(r),
        "ttft_s": {f"p{int(q * 100)}": r.ttft_q(q) for q in (0.5, 0.9, 0.99)},
        "itl_s": {f"p{int(q * 100)}": r.itl_q(q) for q in (0.5, 0.9, 0.99)},
        "goodput_rps": r.goodput,
        "requests": r.requests,
        "roles": {
            k: {
                "instances": v.instances,
                "utilisation": v.utilisation,
                "mean_running": v.mean_running,
                "mean_kv_usage": v.mean_kv_usage,
                "preemptions": v.preemptions,
            }
            for k, v in r.roles.items()
        },
    }


def plan_json(plan: Plan, profile: Profile) -> dict[str, Any]:
    """The plan as JSON-ready data (same content as `plan_text`)."""
    return {
        "slo": str(plan.slo),
        "estimate": {"prefill": plan.estimate[0], "decode": plan.estimate[1]},
        "recommended": _result_json(plan, plan.best),
        "flags": recommended_flags(profile, plan.best) if plan.best else None,
        "neighbours": [_result_json(plan, n) for n in plan.neighbours],
        "plain_same_gpus": _result_json(plan, plan.plain_same),
        "plain_fewest": _result_json(plan, plan.plain_min),
        "reason": plan.reason,
        "fleets_simulated": len(plan.runs),
        "cpu_s": plan.seconds,
    }


def verify_text(
    plan: Plan, profile: Profile, requests: Sequence[RequestSpec], warmup_s: float
) -> str:
    """Re-simulates the recommendation and its neighbours on other `requests` (a fresh seed,
    a longer window) and renders the same table: the check that the answer is not an artefact
    of one sample."""
    lines = [
        "",
        f"verification: {len(requests)} requests (fresh seed), warm-up {warmup_s:.0f} s",
        "",
        "| fleet | XpYd | GPUs | SLO | TTFT p50/p90/p99 s | ITL p50/p90/p99 ms | goodput req/s "
        "| per role |",
        "|---|---|---|---|---|---|---|---|",
    ]
    assert plan.best is not None
    ttft_b, itl_b = plan.slo.bound("ttft"), plan.slo.bound("itl")
    for what, r in [("recommended", plan.best), *(("neighbour", n) for n in plan.neighbours)]:
        again = simulate_fleet(
            profile, requests, r.config, ttft_slo_s=ttft_b, itl_slo_s=itl_b, warmup_s=warmup_s
        )
        lines.append(_row(plan, again, what))
    return "\n".join(lines) + "\n"
