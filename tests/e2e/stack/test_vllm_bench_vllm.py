"""`vllm bench serve`, the field's load generator, runs against the gateway as against
`vllm serve`: the `vllm` command of this environment starts, takes the model and its tokenizer
from /v1/models, aligns its prompts through /tokenize and /detokenize, and every request
succeeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_bench_serve_runs_against_the_gateway(gateway_url: str, tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "pdplane.cli.vllm_console",  # what the `vllm` console script runs
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        gateway_url,
        "--dataset-name",
        "random",
        "--random-input-len",
        "48",
        "--random-output-len",
        "4",
        "--ignore-eos",
        "--num-prompts",
        "6",
        "--max-concurrency",
        "2",
        "--seed",
        "0",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "result.json",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "/tokenize unavailable" not in output, output[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (6, 0), output[-4000:]
    assert result["total_output_tokens"] == 6 * 4
    assert "Serving Benchmark Result" in output
