"""`pdplane profile --url URL --out FILE`: measure an engine profile from a running instance.

    pdplane profile --url http://127.0.0.1:8100 --out my-profile.json [--base tiny-cpu]
                    [--grid cpu|gpu] [--repeats 2] [--kv-blocks N --block-size N]
                    [--max-num-seqs N --max-num-batched-tokens N] [--name NAME]

URL is one vLLM instance (under `pdplane up` from port 8100 on), not the gateway: through the
gateway the sweep would measure the whole P/D path. A short sweep through the instance's OpenAI
API (`pdplane.plan.sweep`: cells of B concurrent streamed requests x L-token prompts x O outputs;
TTFT grows with prompt tokens and batch, ITL with the decode batch and its context), then the
cost model fitted to it (`pdplane.plan.fit`: the engine model itself run on the same cells,
Nelder-Mead on the log errors; a burst cell's TTFT is left out of the fit, its ITL kept).
Capacity comes from the instance: `vllm:cache_config_info` in `/metrics` (`num_gpu_blocks`,
`block_size`) and `max_model_len` from `/v1/models`; what the API does not say
(`--max-num-seqs`, `--max-num-batched-tokens`, the KV layout) is taken from `--base` or the flags.
The file is the simulator's profile format (`pdplane sim --profile FILE`, `pdplane plan --profile
FILE`). Exit codes: 0 written, 1 the instance failed (or the file could not be written after the
sweep), 2 bad flags (an --out that cannot be written or a --model the instance does not serve is
found before the sweep).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import Field

from pdplane.core.settings import CommandSettings
from pdplane.plan.fit import fit_cost, predict, unbatched_ttft_weight
from pdplane.plan.sweep import Cell, CellResult, error_message, measure_cells
from pdplane.sim.profiles import Profile, load_profile

__all__ = [
    "GRIDS",
    "ProfileSettings",
    "http_error_line",
    "instance_capacity",
    "main",
    "measure_profile",
    "out_problem",
]

#: the sweep's cells: batch x prompt tokens, a fixed number of outputs
GRIDS: dict[str, list[Cell]] = {
    "cpu": [Cell(b, n, 32) for b in (1, 4, 16) for n in (64, 256, 768)],
    "gpu": [Cell(b, n, 64) for b in (1, 16, 64) for n in (256, 1024, 4096)],
}


class ProfileSettings(CommandSettings):
    """Flags of `pdplane profile` (each also a `PDPLANE_*` environment variable)."""

    url: str = Field(description="the instance's OpenAI base URL (http://host:port)")
    out: Path = Field(description="profile JSON file to write")
    model: str = Field("", description="served model name (default: the first of /v1/models)")
    base: str = Field(
        "tiny-cpu", description="profile supplying what the API does not say (and fit start)"
    )
    name: str = Field("", description="name of the measured profile (default: <base>-measured)")
    grid: Literal["cpu", "gpu"] = Field("cpu", description="sweep cells")
    repeats: int = Field(2, ge=1, description="runs of each cell")
    kv_blocks: int | None = Field(None, ge=1, description="KV blocks (default: from /metrics)")
    block_size: int | None = Field(None, ge=1, description="tokens per block (from /metrics)")
    max_num_seqs: int | None = Field(None, ge=1, description="the instance's --max-num-seqs")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="the instance's --max-num-batched-tokens"
    )


def instance_capacity(url: str) -> dict[str, Any]:
    """What the instance says of itself: `models` (every served id), `model` (the first),
    `max_model_len` (/v1/models) and vLLM's `vllm:cache_config_info` labels (/metrics;
    `num_gpu_blocks`, `block_size`, ...; empty when absent). Raises httpx.HTTPError when
    unreachable or answering an error, RuntimeError when /v1/models is not the OpenAI list."""
    base = url.rstrip("/")
    models = httpx.get(f"{base}/v1/models", timeout=10)
    models.raise_for_status()
    try:
        listed = models.json()
        data = [m for m in listed.get("data") or [] if isinstance(m, dict)] or [{}]
    except (ValueError, AttributeError):
        raise RuntimeError("/v1/models is not an OpenAI model list") from None
    out: dict[str, Any] = {
        "models": [str(m["id"]) for m in data if m.get("id")],
        "model": data[0].get("id", ""),
        "max_model_len": None,
    }
    if data[0].get("max_model_len"):
        out["max_model_len"] = int(data[0]["max_model_len"])
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    cache: dict[str, str] = {}
    for fam in text_string_to_metric_families(metrics):
        if fam.name.startswith("vllm:cache_config_info"):
            for s in fam.samples:
                cache = dict(s.labels)
    out["cache_config"] = cache
    return out


def _capacity(s: ProfileSettings, base: Profile, info: dict[str, Any]) -> Profile:
    cache = info["cache_config"]
    blocks = s.kv_blocks or (int(cache["num_gpu_blocks"]) if cache.get("num_gpu_blocks") else 0)
    bsize = s.block_size or (int(cache["block_size"]) if cache.get("block_size") else 0)
    return dataclasses.replace(
        base,
        num_blocks=blocks or base.num_blocks,
        block_size=bsize or base.block_size,
        max_model_len=info["max_model_len"] or base.max_model_len,
        max_num_seqs=s.max_num_seqs or base.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens or base.max_num_batched_tokens,
    )


def measure_profile(
    url: str, model: str, base: Profile, cells: list[Cell], *, repeats: int = 2
) -> tuple[Profile, list[CellResult], float]:
    """Sweeps `cells` on the instance and fits `base`'s cost model to them (TTFT from the cells
    without a burst of arrivals, ITL from all: `pdplane.plan.fit.unbatched_ttft_weight`).

    Returns (fitted profile, measured cells, fit score). Raises RuntimeError when a cell got no
    answer at all, naming the cells and the instance's first error.
    """
    real = asyncio.run(measure_cells(url.rstrip("/"), model, cells, repeats=repeats))
    bad = [r for r in real if not r.ttft_s]
    if bad:
        first = next((r.first_error for r in bad if r.first_error), "")
        why = f" (first error: {first})" if first else ""
        raise RuntimeError(f"no answer in cells {', '.join(r.cell.name for r in bad)}{why}")
    cost, score = fit_cost(base, real, ttft_weight=unbatched_ttft_weight)
    return dataclasses.replace(base, cost=cost), real, score


def error_table(profile: Profile, real: list[CellResult]) -> tuple[str, float, float]:
    """Markdown table of measured vs engine-model TTFT (median) and ITL (mean) per cell, and
    the median relative errors (TTFT, ITL)."""
    lines = [
        "| cell | measured TTFT ms | model TTFT ms | err | measured ITL ms | model ITL ms | err |",
        "|---|---|---|---|---|---|---|",
    ]
    et, ei = [], []
    for r in real:
        ttft, itl = predict(profile, profile.cost, r.cell)
        a, b = abs(ttft - r.ttft) / r.ttft, abs(itl - r.itl) / r.itl if r.itl else 0.0
        et.append(a)
        ei.append(b)
        lines.append(
            f"| {r.cell.name} | {r.ttft * 1e3:.1f} | {ttft * 1e3:.1f} | {a:.0%} | "
            f"{r.itl * 1e3:.2f} | {itl * 1e3:.2f} | {b:.0%} |"
        )
    med = sorted(et)[len(et) // 2], sorted(ei)[len(ei) // 2]
    lines += ["", f"median error: TTFT {med[0]:.1%}, ITL {med[1]:.1%}"]
    return "\n".join(lines) + "\n", med[0], med[1]


def out_problem(path: Path) -> str | None:
    """Why `path` cannot take the profile file (None when it can): checked before the sweep so
    that a typo in --out costs no measurement."""
    if path.is_dir():
        return "is a directory"
    parent = path.parent
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    if path.exists() and not os.access(path, os.W_OK):
        return "is not writable"
    return None


def http_error_line(exc: httpx.HTTPError) -> str:
    """One line for an httpx error: "GET URL: HTTP 404: <message>" for an error answer (without
    httpx's second, documentation line), the first line of the error otherwise."""
    if isinstance(exc, httpx.HTTPStatusError):
        r = exc.response
        return f"{exc.request.method} {exc.request.url}: {error_message(r.status_code, r.content)}"
    lines = str(exc).splitlines()
    return lines[0] if lines else type(exc).__name__


def _warn_partial(real: list[CellResult]) -> None:
    for r in real:
        if r.errors:
            sent = r.errors + len(r.ttft_s)
            sys.stderr.write(
                f"warning: pdplane profile: cell {r.cell.name}: {r.errors} of {sent} requests "
                f"failed, fitted on {len(r.ttft_s)} (first error: {r.first_error})\n"
            )


def main(argv: list[str]) -> int:
    """Runs `pdplane profile`; see the module docstring for exit codes."""
    s = ProfileSettings.parse(argv, prog="pdplane profile")
    try:
        base = load_profile(s.base)
    except ValueError as exc:
        sys.stderr.write(f"error: pdplane profile: {exc}\n")
        return 2
    problem = out_problem(s.out)
    if problem:
        sys.stderr.write(f"error: pdplane profile: --out {s.out}: {problem}\n")
        return 2
    t0 = time.monotonic()
    try:
        info = instance_capacity(s.url)
        if s.model and s.model not in info["models"]:
            served = ", ".join(info["models"]) or "no model"
            sys.stderr.write(
                f"error: pdplane profile: --model {s.model}: {s.url} serves {served}\n"
            )
            return 2
        base = _capacity(s, base, info)
        model = s.model or info["model"]
        cells = [c for c in GRIDS[s.grid] if c.prompt + c.output <= base.max_model_len]
        fitted, real, score = measure_profile(s.url, model, base, cells, repeats=s.repeats)
    except httpx.HTTPError as exc:
        sys.stderr.write(f"pdplane profile: {s.url}: {http_error_line(exc)}\n")
        return 1
    except (RuntimeError, OSError) as exc:
        sys.stderr.write(f"pdplane profile: {s.url}: {exc}\n")
        return 1
    _warn_partial(real)
    when = time.strftime("%Y-%m-%d")
    name = s.name or f"{s.base.removesuffix('.json')}-measured"
    fitted = dataclasses.replace(
        fitted,
        name=name,
        description=f"{model} at {s.url}, measured by pdplane profile",
        sources=(
            f"measured: pdplane profile --grid {s.grid} {when}, {len(cells)} cells x "
            f"{s.repeats}, fit score {score:.3f}",
            f"capacity: num_gpu_blocks {fitted.num_blocks}, block_size {fitted.block_size} "
            f"({'vllm:cache_config_info' if info['cache_config'] else 'flags / --base'}), "
            f"max_model_len {fitted.max_model_len}",
        ),
    )
    try:
        s.out.write_text(json.dumps(fitted.to_dict(), indent=1) + "\n")
    except OSError as exc:
        sys.stderr.write(f"pdplane profile: --out {s.out}: {exc}\n")
        return 1
    table, _, _ = error_table(fitted, real)
    sys.stdout.write(
        f"profile {name} -> {s.out} ({time.monotonic() - t0:.0f} s; fit score {score:.3f})\n"
        f"{fitted.cost}\n\n{table}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
