#!/usr/bin/env bash
# Real vLLM on GPUs with pdplane's NCCL transport, end to end (bench/gpu/e2e.py says what it
# checks; arguments pass through, e.g. `--placement split` on a machine with two GPUs). Run from
# the checkout root on the GPU machine after vLLM 0.26 was installed into /tmp/site as
# ../shared/gpu-vllm/README describes (prepare.sh here, then the part/deps copies and
# install-on-gpu.sh there). The pdplane wheels the GPU image and vLLM's dependencies lack
# (grpcio 1.85, protobuf 7.36, grpcio-health-checking, grpcio-reflection, pydantic-settings,
# python-dotenv, httptools) travel in .whl/base (carry it); fetch them here with
# `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 -d .whl/base NAME==VERSION`. Instances sharing a GPU start
# together, so pass --kv-cache-memory BYTES (vLLM's memory profiling fails when they start at
# once with only --gpu-memory-utilization).
# Writes $OUT/NAME.json (the driver's output: $OUT/NAME.txt), the processes' logs
# ($OUT/NAME-logs.tgz) and the NCCL channels the instances opened (which transport NCCL took:
# $OUT/NAME-nccl-channels.txt), where NAME is $E2E_NAME (default gpu_e2e), so several runs can
# share one $OUT.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/base/*.whl
export PYTHONPATH="/tmp/site:$PWD/services:$PWD/connector:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export NCCL_DEBUG="${NCCL_DEBUG:-INFO}"
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
out="${OUT:-/tmp/pdplane-e2e-out}"
name="${E2E_NAME:-gpu_e2e}"
work=/tmp/pdplane-e2e
rm -rf "$work/"*.log "$out/$name.json"
mkdir -p "$out" "$work"
rc=0
python3 bench/gpu/e2e.py --work "$work" --out "$out/$name.json" "$@" > "$out/$name.txt" 2>&1 || rc=$?
[ -f "$out/$name.json" ] || { tail -30 "$out/$name.txt"; exit "$((rc ? rc : 1))"; }
python3 - "$out/$name.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
print("ok", r["ok"], "tp", r.get("tp"), "placement", r.get("placement"),
      "startup_s", r.get("startup_s"), "error", str(r.get("error"))[:2000])
for mode, v in r["modes"].items():
    print(mode, "ok", v.get("ok"), "transports", v.get("transports"), v.get("decode_loads"), str(v.get("error") or "")[:2000])
    for q in v.get("requests", []):
        print("  ", {k: q[k] for k in ("prompt_tokens", "external_tokens", "text_equal",
                                       "stream_text_equal", "stream_ttft_ms",
                                       "kv_loaded", "gateway_ms", "single_ms")})
PY
tar czf "$out/$name-logs.tgz" -C "$work" $(cd "$work" && ls *.log) 2>/dev/null || true
grep -h " via " "$work"/*.log | sed 's/^.*NCCL INFO //' | sort | uniq -c \
  > "$out/$name-nccl-channels.txt" || true
head -4 "$out/$name-nccl-channels.txt"
exit "$rc"
