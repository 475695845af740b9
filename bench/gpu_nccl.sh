#!/usr/bin/env bash
# The NCCL data path on the GPU machine, in one go: `pytest tests/gpu`, then bench/nccl_pull.py
# with both KV nodes on GPU 0 (NCCL socket transport between two "hosts") and, where the machine
# has two or more GPUs, with decode on GPU 1 (NVLink / PCIe P2P). Run from the checkout root.
# Writes under $OUT: pytest.txt, nccl_pull_1gpu.json, nccl_pull_2gpu.json and the NCCL channels
# each run opened (nccl_channels_*.txt: which transport NCCL took). The grpcio/protobuf the
# generated code needs travel in .whl/base (carry it; see bench/gpu_e2e.sh).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/base/*.whl || { echo "cannot install .whl/base (carry it)"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD/services:$PWD/connector:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
out="${OUT:-/tmp/pdplane-nccl-out}"
mkdir -p "$out"
rc=0
python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tail -30 | tee "$out/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
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
  echo "== bench/nccl_pull.py $name"
  NCCL_DEBUG=INFO NCCL_DEBUG_FILE="$logs/nccl.%p.txt" \
    python3 bench/nccl_pull.py "${extra[@]}" --log-dir "$logs" --out "$out/nccl_pull_$name.json" \
    || rc=1
  grep -h " via " "$logs"/nccl.*.txt | sed 's/^.*NCCL INFO //' | sort | uniq -c \
    > "$out/nccl_channels_$name.txt" || true
  head -5 "$out/nccl_channels_$name.txt"
done
exit "$rc"
