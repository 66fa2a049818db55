#!/usr/bin/env bash
# Installs everything kvmesh and its tests need on a fresh Debian machine:
# redis-server (Debian package), the pinned Python packages, kvmesh itself
# (editable) and the npm tools (buf). Safe to re-run: each step is skipped
# when already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check -r requirements-test.txt
python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .

if [ -f package-lock.json ]; then
  npm ci --silent --no-audit --no-fund
fi
