#!/usr/bin/env bash
# Builds the tools that validate deploy/helm/ offline, at pinned versions, into
# .tools/bin (gitignored) beside the protoc plugins: helm and kubectl-validate,
# from the Go module proxy. Also fetches the Go test's modules
# (deploy/helm/validate) and prometheus-operator's release, whose ServiceMonitor
# CRD kubectl-validate checks against (tests/deploy/test_helm_chart.py).
# Each step is skipped when already satisfied. Called by scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM=v3.22.0
KUBECTL_VALIDATE=v0.0.4

bin="$PWD/.tools/bin"
# `helm version` of a `go install`ed helm does not say the patch version; the build info does.
built() { go version -m "$bin/$1" 2>/dev/null | awk '$1 == "mod" {print $3}'; }
if [[ "$(built helm)" != "$HELM" ]]; then
  GOBIN="$bin" go install "helm.sh/helm/v3/cmd/helm@$HELM"
fi
if [[ "$(built kubectl-validate)" != "$KUBECTL_VALIDATE" ]]; then
  GOBIN="$bin" go install "sigs.k8s.io/kubectl-validate@$KUBECTL_VALIDATE"
fi

# The operator release is the one whose Go types the test decodes into (go.mod pins it).
operator=$(cd deploy/helm/validate && go mod download && go list -m -f '{{.Version}}' \
  github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring)
go mod download "github.com/prometheus-operator/prometheus-operator@$operator"
# KEDA's release, whose ScaledObject CRD kubectl-validate checks the chart's ScaledObjects against (the test pins it).
(cd deploy/helm/validate && go mod download "github.com/kedacore/keda/v2@v2.20.2")
# Compile the test once (k8s.io/api is big): `make test` then reuses the build cache.
(cd deploy/helm/validate && go test -count=1 -run '^$' ./... >/dev/null)
