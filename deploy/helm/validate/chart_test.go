package validate

import (
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

var (
	renderedDir = flag.String("rendered", "", "directory of `helm template` outputs, one <case>.yaml per values file")
	flagsFile   = flag.String("flags", "", "JSON {service: {env var: {\"required\": bool}}}: the flags each service defines (scripts/flag_tables.py)")
	gpuCases    = flag.String("gpu-cases", "", "comma-separated cases whose prefill and decode must request GPUs")
	callersFile = flag.String("callers", "", "JSON {service: [caller roles] or \"*\"}: the authorization table per service (scripts/authz_edges.py)")
)

// The six kvmesh services: the component label of their pods, and their container's name.
var services = []string{"gateway", "router", "kvstore", "speculator", "prefill", "decode"}

// Environment variables a kvmesh container may have that are not flags: the
// runtime's own settings and the downward-API value KVMESH_ADVERTISE_ADDRESS is built from.
var nonFlagEnv = []string{"PYTHONUNBUFFERED", "POD_IP"}

// Which service each address flag must point at.
var addressOf = map[string]string{
	"KVMESH_ROUTER_ADDRESS":     "router",
	"KVMESH_KVSTORE_ADDRESS":    "kvstore",
	"KVMESH_SPECULATOR_ADDRESS": "speculator",
}

const gpuResource corev1.ResourceName = "nvidia.com/gpu"

var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

type flagInfo struct {
	Required bool `json:"required"`
}

func loadFlags(t *testing.T) map[string]map[string]flagInfo {
	t.Helper()
	raw, err := os.ReadFile(*flagsFile)
	if err != nil {
		t.Fatalf("-flags: %v", err)
	}
	var flags map[string]map[string]flagInfo
	if err := json.Unmarshal(raw, &flags); err != nil {
		t.Fatalf("-flags %s: %v", *flagsFile, err)
	}
	for _, s := range services {
		if len(flags[s]) == 0 {
			t.Fatalf("-flags %s has no flags for %s", *flagsFile, s)
		}
	}
	return flags
}

func TestRenderedChart(t *testing.T) {
	if *renderedDir == "" || *flagsFile == "" {
		t.Fatal("run through tests/deploy/test_helm_chart.py, which passes -rendered and -flags")
	}
	flags := loadFlags(t)
	cases, err := renderedCases(*renderedDir)
	if err != nil || len(cases) == 0 {
		t.Fatalf("no rendered cases in %s (%v)", *renderedDir, err)
	}
	wantGPU := strings.Split(*gpuCases, ",")
	for _, path := range cases {
		name := strings.TrimSuffix(filepath.Base(path), ".yaml")
		t.Run(name, func(t *testing.T) {
			r, err := decodeFile(path)
			if err != nil {
				t.Fatalf("strict decode: %v", err)
			}
			c := &checker{t: t, r: r, flags: flags}
			c.servicesRun()
			for _, w := range r.Workloads {
				c.workload(w)
			}
			c.gpus(slices.Contains(wantGPU, name))
			c.serviceSelectors()
			c.pdbs()
			c.hpas()
			c.scaledObjects()
			c.serviceMonitors()
			c.modelCache()
			c.networkPolicies(loadCallers(t))
		})
	}
}

type checker struct {
	t     *testing.T
	r     *Render
	flags map[string]map[string]flagInfo
}

func (c *checker) errorf(format string, args ...any) {
	c.t.Helper()
	c.t.Errorf(format, args...)
}

// component is a pod template's service, "" for pods that are not a kvmesh service (Redis).
func component(tpl corev1.PodTemplateSpec) string {
	if tpl.Labels["app.kubernetes.io/name"] != "kvmesh" {
		return ""
	}
	if s := tpl.Labels["app.kubernetes.io/component"]; slices.Contains(services, s) {
		return s
	}
	return ""
}

func (c *checker) workloadOf(service string) *Workload {
	for i := range c.r.Workloads {
		if component(c.r.Workloads[i].Template) == service {
			return &c.r.Workloads[i]
		}
	}
	return nil
}

// Every kvmesh service runs, exactly once.
func (c *checker) servicesRun() {
	for _, s := range services {
		n := 0
		for _, w := range c.r.Workloads {
			if component(w.Template) == s {
				n++
			}
		}
		if n != 1 {
			c.errorf("%d workloads run %s, want 1", n, s)
		}
	}
}

func envMap(ct corev1.Container) map[string]corev1.EnvVar {
	m := map[string]corev1.EnvVar{}
	for _, e := range ct.Env {
		m[e.Name] = e
	}
	return m
}

func portNamed(ct corev1.Container, name string) (int32, bool) {
	for _, p := range ct.Ports {
		if p.Name == name {
			return p.ContainerPort, true
		}
	}
	return 0, false
}

func (c *checker) workload(w Workload) {
	where := w.Kind + "/" + w.Name
	sel, err := metav1.LabelSelectorAsSelector(w.Selector)
	if err != nil || sel.Empty() || !sel.Matches(labels.Set(w.Template.Labels)) {
		c.errorf("%s: its selector %v does not select its own pod template (%v)", where, w.Selector, err)
	}
	if w.Kind == "StatefulSet" && !c.headlessServiceFor(w) {
		c.errorf("%s: serviceName %q is not a rendered headless Service selecting its pods", where, w.ServiceName)
	}
	s := component(w.Template)
	if s == "" {
		return
	}
	spec := w.Template.Spec
	if sc := spec.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
		c.errorf("%s: not runAsNonRoot (the image runs as its kvmesh user)", where)
	}
	if len(spec.Containers) != 1 || spec.Containers[0].Name != s {
		c.errorf("%s: want one container named %s", where, s)
		return
	}
	ct := spec.Containers[0]
	if len(ct.Args) != 1 || ct.Args[0] != s {
		c.errorf("%s: args %v, want [%s] (the image's entry point is `kvmesh`)", where, ct.Args, s)
	}
	env := envMap(ct)
	if len(env) != len(ct.Env) {
		c.errorf("%s: an env var is set twice", where)
	}
	// Kubernetes expands $(VAR) only for variables defined earlier in the list.
	for i, e := range ct.Env {
		for _, ref := range envRef.FindAllStringSubmatch(e.Value, -1) {
			if !slices.ContainsFunc(ct.Env[:i], func(d corev1.EnvVar) bool { return d.Name == ref[1] }) {
				c.errorf("%s: %s uses $(%s), which is not defined before it", where, e.Name, ref[1])
			}
		}
	}
	c.envMatchesFlags(where, s, ct)
	port := c.intEnv(where, env, "KVMESH_PORT")
	if p, ok := portNamed(ct, "grpc"); !ok || int(p) != port {
		c.errorf("%s: container port grpc is %d, KVMESH_PORT is %d", where, p, port)
	}
	if p, ok := portNamed(ct, "metrics"); !ok || int(p) != c.intEnv(where, env, "KVMESH_METRICS_PORT") {
		c.errorf("%s: container port metrics %d is not KVMESH_METRICS_PORT", where, p)
	}
	if h := env["KVMESH_HOST"].Value; h != "0.0.0.0" && h != "::" {
		c.errorf("%s: KVMESH_HOST=%q: probes and peers dial the pod IP, so it must bind every interface", where, h)
	}
	for name, probe := range map[string]*corev1.Probe{"startup": ct.StartupProbe, "readiness": ct.ReadinessProbe, "liveness": ct.LivenessProbe} {
		switch {
		case probe == nil:
			c.errorf("%s: no %s probe", where, name)
		// A kubelet gRPC probe cannot present a client certificate: /healthz on the metrics port.
		case probe.HTTPGet == nil || probe.HTTPGet.Path != "/healthz":
			c.errorf("%s: %s probe is not GET /healthz", where, name)
		case probe.HTTPGet.Port.String() != "metrics":
			c.errorf("%s: %s probe dials port %s, not the metrics port", where, name, probe.HTTPGet.Port.String())
		}
	}
	if ct.StartupProbe != nil && (s == "prefill" || s == "decode") {
		if budget := ct.StartupProbe.PeriodSeconds * ct.StartupProbe.FailureThreshold; budget < 300 {
			c.errorf("%s: the startupProbe allows %ds; loading a model takes minutes", where, budget)
		}
	}
	c.drain(where, spec, ct, env)
	c.addresses(where, env)
	c.modelMount(where, spec, ct, env)
}

func (c *checker) headlessServiceFor(w Workload) bool {
	for _, svc := range c.r.Services {
		if svc.Name == w.ServiceName && svc.Spec.ClusterIP == corev1.ClusterIPNone &&
			slices.ContainsFunc(c.selected(svc.Spec.Selector), func(o Workload) bool { return o.Name == w.Name }) {
			return true
		}
	}
	return false
}
