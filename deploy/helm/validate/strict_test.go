package validate

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The decoder the chart test relies on refuses what the API server would.
func TestStrictDecodeRejects(t *testing.T) {
	cases := map[string]struct{ doc, want string }{
		"unknown field": {"apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {selectr: {a: b}}\n", "unknown field"},
		"wrong type":    {"apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec: {replicas: two}\n", "cannot unmarshal"},
		"duplicate key": {"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\ndata: {c: d}\n", "already set"},
		"unknown kind":  {"apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n", "not a kind this test knows"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "x.yaml")
			if err := os.WriteFile(path, []byte("---\n"+tc.doc), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := decodeFile(path)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("decodeFile = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
