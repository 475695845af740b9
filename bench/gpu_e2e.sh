#!/usr/bin/env bash
# Real vLLM on one GPU with pdplane's NCCL transport, end to end (bench/gpu_e2e.py says what
# it checks). Run from the checkout root on the GPU machine after vLLM 0.26 was installed into
# /tmp/site as ../shared/gpu-vllm/README describes (prepare.sh here, then the part/deps copies
# and install-on-gpu.sh there). The pdplane wheels the GPU image lacks (grpcio 1.85,
# protobuf 7.36, grpcio-health-checking, grpcio-reflection, pydantic-settings, python-dotenv)
# travel in .whl/base (carry it).
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/base/*.whl
export PYTHONPATH="/tmp/site:$PWD/services:$PWD/connector:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
out="${OUT:-/tmp/pdplane-e2e}"
mkdir -p "$out"
python3 bench/gpu_e2e.py --work /tmp/pdplane-e2e --out "$out/gpu_e2e.json" "$@"
