#!/usr/bin/env bash
# Installs what the Go and TypeScript clients need to be generated, built and
# tested, at pinned versions: the Go protoc plugins into .tools/bin (gitignored),
# clients/go's modules, clients/typescript's npm packages (its package-lock.json,
# which also pins protoc-gen-es). Each step is skipped when already satisfied.
# Called by scripts/install.sh and scripts/gen_protos.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

# The generated Go code names these versions, so only they may produce it.
PROTOC_GEN_GO=v1.36.12
PROTOC_GEN_GO_GRPC=v1.6.2

bin="$PWD/.tools/bin"
if [[ "$("$bin/protoc-gen-go" --version 2>/dev/null)" != "protoc-gen-go $PROTOC_GEN_GO" ]]; then
  GOBIN="$bin" go install "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO"
fi
if [[ "$("$bin/protoc-gen-go-grpc" --version 2>/dev/null)" != "protoc-gen-go-grpc ${PROTOC_GEN_GO_GRPC#v}" ]]; then
  GOBIN="$bin" go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC"
fi

(cd clients/go && go mod download)

# npm writes node_modules/.package-lock.json on every install: newer than the
# lock file means the lock file is what is installed.
ts=clients/typescript
if [[ ! "$ts/node_modules/.package-lock.json" -nt "$ts/package-lock.json" ]]; then
  (cd "$ts" && npm ci --silent --no-audit --no-fund)
fi
