package validate

import (
	"encoding/json"
	"os"
	"slices"
	"testing"

	networkingv1 "k8s.io/api/networking/v1"
)

// loadCallers reads -callers: per service, the roles that may call it, or "*" for a public one.
func loadCallers(t *testing.T) map[string][]string {
	t.Helper()
	raw, err := os.ReadFile(*callersFile)
	if err != nil {
		t.Fatalf("-callers: %v", err)
	}
	var table map[string]any
	if err := json.Unmarshal(raw, &table); err != nil {
		t.Fatalf("-callers %s: %v", *callersFile, err)
	}
	out := map[string][]string{}
	for s, v := range table {
		switch roles := v.(type) {
		case string:
			out[s] = []string{roles}
		case []any:
			for _, r := range roles {
				out[s] = append(out[s], r.(string))
			}
		}
	}
	return out
}

// Each service has one NetworkPolicy; every pod it admits from is a role the authorization table lets
// call that service, every such role is admitted, and only a public service or the metrics port takes
// traffic from outside the mesh's own pods.
func (c *checker) networkPolicies(callers map[string][]string) {
	for _, s := range services {
		var mine []*networkingv1.NetworkPolicy
		for _, p := range c.r.Policies {
			if p.Spec.PodSelector.MatchLabels["app.kubernetes.io/component"] == s &&
				p.Spec.PodSelector.MatchLabels["app.kubernetes.io/name"] == "kvmesh" {
				mine = append(mine, p)
			}
		}
		if len(mine) != 1 {
			c.errorf("%s: %d NetworkPolicies select its pods, want 1", s, len(mine))
			continue
		}
		allowed, public := callers[s], slices.Equal(callers[s], []string{"*"})
		admitted := map[string]bool{}
		for _, rule := range mine[0].Spec.Ingress {
			metricsOnly := len(rule.Ports) == 1 && rule.Ports[0].Port != nil && rule.Ports[0].Port.String() == "metrics"
			for _, peer := range rule.From {
				role := ""
				if peer.PodSelector != nil && peer.NamespaceSelector == nil {
					role = peer.PodSelector.MatchLabels["app.kubernetes.io/component"]
				}
				switch {
				case metricsOnly || public:
				case role == "":
					c.errorf("%s: NetworkPolicy admits %+v, which is no role of the mesh", s, peer)
				case !slices.Contains(allowed, role):
					c.errorf("%s: NetworkPolicy admits %s, which the authorization table does not let call it", s, role)
				default:
					admitted[role] = true
				}
			}
			if len(rule.From) == 0 && !metricsOnly && !public {
				c.errorf("%s: a NetworkPolicy rule admits anyone on %v", s, rule.Ports)
			}
		}
		if !public {
			for _, role := range allowed {
				if !admitted[role] {
					c.errorf("%s: the authorization table lets %s call it, its NetworkPolicy does not", s, role)
				}
			}
		}
	}
}
