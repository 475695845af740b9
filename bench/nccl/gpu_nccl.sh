#!/usr/bin/env bash
# The NCCL data path on the GPU machine, in one go: `pytest tests/gpu`, then bench/nccl/pull.py
# with both KV nodes on GPU 0 (NCCL socket transport between two "hosts") and, where the machine
# has two or more GPUs, with decode on GPU 1 (NVLink / PCIe P2P), then bench/nccl/comm_memory.py
# (GPU memory per communicator at 8/32/128 communicators, by NCCL setting). Run from the
# checkout root. Writes under $OUT: pytest.txt, nccl_pull_1gpu.json (nccl_pull_2gpu.json),
# nccl_comm_memory.json, the NCCL channels each pull run opened (nccl_channels_*.txt: which
# transport NCCL took) and gpu_nccl.log (everything printed). The wheels the GPU image lacks
# (grpcio, protobuf, grpcio-health-checking, grpcio-reflection, pydantic-settings, python-dotenv,
# and for the registry the tests start: pydantic, pydantic-core, annotated-types,
# typing-inspection) travel in .whl/base (carry it; see bench/gpu/e2e.sh). Each step has its
# own time bound (GPU_TESTS_S, GPU_PULL_S, GPU_MEMORY_S seconds) so that the whole run ends
# within one call of the machine; GPU_TESTS_K selects tests (pytest -k) for a shorter re-run.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/base/*.whl || { echo "cannot install .whl/base (carry it)"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD/services:$PWD/connector:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
out="${OUT:-/tmp/pdplane-nccl-out}"
mkdir -p "$out"
exec > >(tee "$out/gpu_nccl.log") 2>&1
rc=0
echo "== pytest tests/gpu"
timeout "${GPU_TESTS_S:-330}" python3 -m pytest tests/gpu -q -rs -p no:cacheprovider \
  ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} > "$out/pytest.txt" 2>&1
[ $? -eq 0 ] || rc=1
tail -40 "$out/pytest.txt"
# tests/gpu skips without CUDA or libnccl: here that is a failure, not a pass
grep -q " skipped" "$out/pytest.txt" && { echo "tests/gpu skipped tests"; rc=1; }
gpus=$(nvidia-smi -L | wc -l)
runs=(1gpu)
[ "$gpus" -ge 2 ] && runs+=(2gpu)
for name in "${runs[@]}"; do
  logs=/tmp/pdplane-nccl-logs-$name
  rm -rf "$logs" && mkdir -p "$logs"
  extra=()
  [ "$name" = 2gpu ] && extra=(--decode-device 1)
  echo "== bench/nccl/pull.py $name"
  NCCL_DEBUG=INFO NCCL_DEBUG_FILE="$logs/nccl.%p.txt" timeout "${GPU_PULL_S:-170}" \
    python3 bench/nccl/pull.py "${extra[@]}" --log-dir "$logs" --out "$out/nccl_pull_$name.json" \
    || rc=1
  grep -h " via " "$logs"/nccl.*.txt | sed 's/^.*NCCL INFO //' | sort | uniq -c \
    > "$out/nccl_channels_$name.txt" || true
  head -5 "$out/nccl_channels_$name.txt"
done
echo "== bench/nccl/comm_memory.py"
timeout "${GPU_MEMORY_S:-150}" python3 bench/nccl/comm_memory.py \
  --budget-s "$(( ${GPU_MEMORY_S:-150} - 30 ))" --out "$out/nccl_comm_memory.json" || rc=1
exit "$rc"
