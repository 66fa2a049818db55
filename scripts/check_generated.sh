#!/usr/bin/env bash
# Fails when the checked-in generated code differs from what protos/ produce:
# regenerates, then looks for modified, deleted or new files under the
# generated packages. Run from anywhere: make gen-check.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/gen_protos.sh
# Everything gen_protos.sh writes, including packages of protos since deleted.
paths=(kvmesh/api clients/go/gen clients/typescript/src/gen)
status=0
if ! git diff --exit-code --stat -- "${paths[@]}"; then
  status=1
fi
untracked=$(git ls-files --others --exclude-standard -- "${paths[@]}")
if [[ -n "$untracked" ]]; then
  echo "untracked generated files:"
  echo "$untracked"
  status=1
fi
if [[ $status -ne 0 ]]; then
  echo "generated code is stale: run 'make gen' and commit the result" >&2
fi
exit $status
