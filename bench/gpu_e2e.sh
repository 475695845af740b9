#!/usr/bin/env bash
# Real vLLM on GPUs with pdplane's NCCL transport, end to end (bench/gpu_e2e.py says what it
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
# Writes $OUT/gpu_e2e.json, the processes' logs under $OUT/logs and, with NCCL_DEBUG=INFO, the
# NCCL channels the instances opened (which transport NCCL took) in $OUT/nccl_channels.txt.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/base/*.whl
export PYTHONPATH="/tmp/site:$PWD/services:$PWD/connector:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export NCCL_DEBUG="${NCCL_DEBUG:-INFO}"
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
out="${OUT:-/tmp/pdplane-e2e-out}"
work=/tmp/pdplane-e2e
rm -rf "$work/"*.log
mkdir -p "$out/logs" "$work"
rc=0
python3 bench/gpu_e2e.py --work "$work" --out "$out/gpu_e2e.json" "$@" || rc=$?
for log in "$work"/*.log; do tail -c 200000 "$log" > "$out/logs/$(basename "$log")"; done
grep -h " via " "$work"/*.log | sed 's/^.*NCCL INFO //' | sort | uniq -c > "$out/nccl_channels.txt" || true
head -20 "$out/nccl_channels.txt"
exit "$rc"
