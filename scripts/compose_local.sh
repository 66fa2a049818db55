#!/usr/bin/env bash
# The compose mesh in containers on a machine with no container registry and no Docker engine:
# podman (Debian's) runs the containers, Debian's docker-compose drives it through podman's
# Docker-compatible API, and every image is made here from Debian's packages.
#
#   scripts/compose_local.sh images        # base, kvmesh:cpu and redis images (layers cached)
#   scripts/compose_local.sh up [ARGS]     # images, model, API socket, then `docker-compose up -d ARGS`
#   scripts/compose_local.sh compose ARGS  # docker-compose on that mesh (ps, logs, kill ...)
#   scripts/compose_local.sh down          # `docker-compose down -v`, then the API socket stops
#
# Settings (environment): COMPOSE_PROJECT_NAME (kvmesh), KVMESH_COMPOSE_FILE
# (compose/docker-compose.cpu.yml), KVMESH_TORCH_INDEX_URL (empty: PyPI's torch),
# KVMESH_BUILD_FRESH=1 (remake the base, build without the layer cache), and every
# variable the compose file reads (KVMESH_DECODE_REPLICAS, KVMESH_GATEWAY_HTTP_PORT ...).
# On a machine with Docker and a registry none of this is needed: `docker compose -f
# compose/docker-compose.cpu.yml up` builds from the public python image (docs/deploy.md).
#
# Why docker-compose and not podman-compose: compose's start order waits on health
# (`condition: service_healthy`, `service_completed_successfully`), which docker-compose 1.29
# honours and Debian's podman-compose 1.0 ignores.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

export CONTAINERS_CONF="${CONTAINERS_CONF:-$REPO/compose/local/containers.conf}"
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-kvmesh}"
COMPOSE_FILE_PATH="${KVMESH_COMPOSE_FILE:-compose/docker-compose.cpu.yml}"
STATE="${KVMESH_COMPOSE_STATE:-/run/kvmesh-compose/$COMPOSE_PROJECT_NAME}"

BASE_IMAGE=localhost/kvmesh-base:bookworm
export KVMESH_CPU_IMAGE="${KVMESH_CPU_IMAGE:-localhost/kvmesh:cpu}"
export KVMESH_REDIS_IMAGE="${KVMESH_REDIS_IMAGE:-localhost/kvmesh-redis:bookworm}"

log() { echo "compose_local: $*" >&2; }

need_tools() {
  local missing=()
  for tool in podman runc debootstrap docker-compose; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "missing ${missing[*]}: scripts/install.sh installs them (Debian's packages)"
    return 1
  fi
}

# Debian 12 minbase with Python 3.11, trusting what this machine trusts: a machine behind a
# TLS-inspecting proxy has its CA in /usr/local/share/ca-certificates, and pip inside the
# build must accept the same certificates as pip here.
base_image() {
  if [ "${KVMESH_BUILD_FRESH:-}" = 1 ]; then podman rmi -f "$BASE_IMAGE" >/dev/null 2>&1 || true; fi
  if podman image exists "$BASE_IMAGE"; then return; fi
  log "making $BASE_IMAGE with debootstrap (about a minute)"
  local root
  root=$(mktemp -d /var/tmp/kvmesh-base.XXXXXX)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "${KVMESH_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$root.log" 2>&1 \
    || { tail -20 "$root.log" >&2; rm -f "$root.log"; return 1; }
  rm -f "$root.log"
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
  fi
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$root"
}

# `--format docker`: the OCI format drops the Dockerfile's HEALTHCHECK. The build's output goes
# to a log, shown when it fails.
build() {
  local tag=$1; shift
  log "building $tag"
  mkdir -p "$STATE"
  local fresh=()
  if [ "${KVMESH_BUILD_FRESH:-}" = 1 ]; then fresh=(--no-cache); fi
  podman build "${fresh[@]}" --format docker --network host --label org.kvmesh.compose-local=1 -t "$tag" "$@" \
    >"$STATE/build.log" 2>&1 || { tail -30 "$STATE/build.log" >&2; return 1; }
  # The image a rebuild replaced (untagged now; several GB for kvmesh:cpu).
  podman image prune -f --filter label=org.kvmesh.compose-local=1 >/dev/null
}

images() {
  need_tools
  base_image
  build "$KVMESH_REDIS_IMAGE" -f compose/local/redis.Containerfile --build-arg BASE="$BASE_IMAGE" compose/local
  # The first build installs torch (PyPI's CUDA wheels unless KVMESH_TORCH_INDEX_URL says otherwise).
  build "$KVMESH_CPU_IMAGE" -f compose/Dockerfile --ignorefile compose/Dockerfile.dockerignore \
    --build-arg BASE="$BASE_IMAGE" --build-arg TORCH_INDEX_URL="${KVMESH_TORCH_INDEX_URL:-}" .
}

# podman's Docker-compatible API on a socket of this project's own.
api_up() {
  mkdir -p "$STATE"
  export DOCKER_HOST="unix://$STATE/podman.sock"
  if [ -S "$STATE/podman.sock" ] && docker_api_ok; then return; fi
  rm -f "$STATE/podman.sock"
  podman system service --time=0 "$DOCKER_HOST" >"$STATE/podman-service.log" 2>&1 </dev/null &
  echo $! >"$STATE/podman-service.pid"
  for _ in $(seq 100); do
    docker_api_ok && break
    sleep 0.1
  done
  docker_api_ok || { log "podman's API did not come up: $(tail -5 "$STATE/podman-service.log")"; return 1; }
  health_ticker
}

docker_api_ok() {
  python3 - "$STATE/podman.sock" <<'EOF' 2>/dev/null
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(2)
s.connect(sys.argv[1])
s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
sys.exit(0 if b"OK" in s.recv(4096) else 1)
EOF
}

# podman runs each container's health check from a systemd timer; where systemd is not PID 1
# (a container, a sandbox) no timer runs and every service stays "starting" forever, so
# compose's start order never moves. Here a loop does the timers' work for this project.
health_ticker() {
  if [ "$(ps -o comm= 1)" = "systemd" ]; then return; fi
  (
    while sleep 2; do
      for id in $(podman ps -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" 2>/dev/null); do
        podman healthcheck run "$id" >/dev/null 2>&1 &
      done
      wait
    done
  ) >/dev/null 2>&1 </dev/null &
  echo $! >"$STATE/health-ticker.pid"
}

api_down() {
  for name in health-ticker podman-service; do
    if [ -f "$STATE/$name.pid" ]; then
      kill "$(cat "$STATE/$name.pid")" 2>/dev/null || true
      rm -f "$STATE/$name.pid"
    fi
  done
  rm -rf "$STATE"
}

model_dir() {
  if [ -z "${KVMESH_MODEL_DIR:-}" ]; then
    python3 -m kvmesh.cli models install >&2
    KVMESH_MODEL_DIR=$(python3 -m kvmesh.cli models path "${KVMESH_SERVED_MODEL:-smollm2-135m-instruct}")
    export KVMESH_MODEL_DIR
  fi
}

compose() {
  api_up
  docker-compose -f "$COMPOSE_FILE_PATH" "$@"
}

case "${1:-}" in
  images) images ;;
  up)
    shift
    images
    model_dir
    compose up -d --no-build "$@"
    ;;
  compose) shift; compose "$@" ;;
  down)
    compose down -v --remove-orphans
    api_down
    ;;
  *)
    sed -n '2,17p' "$0" >&2
    exit 2
    ;;
esac
