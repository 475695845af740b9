#!/usr/bin/env bash
# The simulator's GPU profile, measured: vLLM (>= 0.26, installed into /tmp/site as
# ../shared/gpu-vllm/README describes) serving a Llama-3-8B-shaped model with random weights
# (--load-format dummy, the tiny tokenizer padded to 128256 ids; nothing is downloaded) on one
# GPU, then `pdplane sim` with the profile fitted to it, on the same cells
# (bench/sim/calibrate.py --target gpu). One command, ~6-8 min on one H200. Run from the
# checkout root on the GPU machine, carrying .whl/base (the pdplane wheels the GPU image lacks,
# as for bench/gpu/e2e.sh).
#
# Writes into $OUT/sim_profile/: profile-llama3-8b-$GPU_NAME.json (load it with
# `pdplane sim --profile FILE`; copy it into the repository), calibration.md (the error table),
# calibration.json, calibration-vllm.json (the vLLM side alone, written as soon as it is
# measured: with it the sim side can be rerun anywhere with --measured), run.txt, vllm.log.
# Extra arguments pass to sim_calibrate.py (e.g. --repeats 3, --eager, --gpu-util 0.8; a dry
# run of this script without a GPU: --target cpu-dummy --repeats 1).
set -euo pipefail
if compgen -G ".whl/base/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/base/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD/services:$PWD/connector:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
out="${OUT:-/tmp/pdplane-sim-profile}/sim_profile"
mkdir -p "$out"
rc=0
# Below the machine's 10-minute command limit, so that whatever was written comes back.
timeout "${CALIB_TIMEOUT_S:-560}" python3 bench/sim/calibrate.py --target gpu \
  --gpu-name "${GPU_NAME:-h200}" --repeats 2 --out "$out" "$@" > "$out/run.txt" 2>&1 || rc=$?
grep -v "Writing model" "$out/run.txt" | tail -30
ls -l "$out"
exit "$rc"
