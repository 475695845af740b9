#!/usr/bin/env bash
# Real vLLM on one GPU with pdplane's NCCL transport, end to end (bench/gpu_e2e.py says what
# it checks). Run from the checkout root on the GPU machine after vLLM 0.26 was installed into
# /tmp/site as ../shared/gpu-vllm/README describes (prepare.sh here, then the part/deps copies
# and install-on-gpu.sh there). The pdplane wheels the GPU image and vLLM's dependencies lack
# (grpcio 1.85, protobuf 7.36, grpcio-health-checking, grpcio-reflection, pydantic-settings,
# python-dotenv, httptools for the gateway's uvicorn) travel in .whl/base (carry it); fetch them
# here with `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 -d .whl/base NAME==VERSION`. Five instances share the GPU:
# pass --kv-cache-memory BYTES to start the vLLM ones together (vLLM's memory profiling fails
# when they start at once with only --gpu-memory-utilization).
# Tried 2026-11-29 (vLLM 0.26.0, one H200): prefill and decode started with the connector on the
# nccl transport and registered; the gateway stopped at startup (httptools missing), so no
# request ran.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/base/*.whl
export PYTHONPATH="/tmp/site:$PWD/services:$PWD/connector:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
out="${OUT:-/tmp/pdplane-e2e}"
mkdir -p "$out"
python3 bench/gpu_e2e.py --work /tmp/pdplane-e2e --out "$out/gpu_e2e.json" "$@"
