// Package validate holds the test that decodes the kvmesh Helm chart's rendered
// manifests strictly into the real Kubernetes API types and checks the chart's
// invariants (validate_test.go). tests/deploy/test_helm_chart.py renders the
// chart over deploy/helm/kvmesh/ci/ and runs it; see deploy/helm/kvmesh/README.md.
package validate
