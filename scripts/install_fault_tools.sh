#!/usr/bin/env bash
# Builds Toxiproxy (Shopify's TCP fault proxy: latency, resets, black holes on a link) at a pinned
# version into .tools/bin/toxiproxy-server, from the Go module proxy. The multi-host tests and
# bench/multihost.py put it in front of a service (kvmesh.launcher.faultproxy). Skipped when already
# built at that version. Called by scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

TOXIPROXY=v2.5.0

bin="$PWD/.tools/bin"
built=$(go version -m "$bin/toxiproxy-server" 2>/dev/null | awk '$1 == "mod" {print $3}' || true)
if [[ "$built" != "$TOXIPROXY" ]]; then
  tmp=$(mktemp -d)
  GOBIN="$tmp" go install "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY"
  mkdir -p "$bin"
  mv "$tmp/server" "$bin/toxiproxy-server"
  rmdir "$tmp"
fi
