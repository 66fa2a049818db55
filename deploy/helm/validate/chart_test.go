package validate

import (
	"encoding/json"
	"flag"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

var (
	renderedDir = flag.String("rendered", "", "directory of `helm template` outputs, one <case>.yaml per values file")
	flagsFile   = flag.String("flags", "", "JSON {service: {env var: {\"required\": bool}}}: the flags each service defines (scripts/flag_tables.py)")
	gpuCases    = flag.String("gpu-cases", "", "comma-separated cases whose prefill and decode must request GPUs")
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
			c.serviceMonitors()
			c.modelCache()
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
		case probe.GRPC == nil:
			c.errorf("%s: %s probe is not a grpc probe", where, name)
		case int(probe.GRPC.Port) != port:
			c.errorf("%s: %s probe dials port %d, the service listens on %d", where, name, probe.GRPC.Port, port)
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

// A model on the cache claim is read where the claim is mounted, read-only, and
// the pod waits for the marker the model-init Job writes inside that folder.
func (c *checker) modelMount(where string, spec corev1.PodSpec, ct corev1.Container, env map[string]corev1.EnvVar) {
	model := env["KVMESH_MODEL"].Value
	var mounted string
	for _, v := range spec.Volumes {
		if v.PersistentVolumeClaim == nil {
			continue
		}
		for _, m := range ct.VolumeMounts {
			if m.Name == v.Name && model != "" && strings.HasPrefix(model, strings.TrimSuffix(m.MountPath, "/")+"/") {
				mounted = m.MountPath
			}
		}
	}
	if mounted == "" {
		return // a model inside the image (model.source=image), or a service without one
	}
	for _, init := range spec.InitContainers {
		if init.Name == "wait-for-model" {
			marker := init.Command[len(init.Command)-1]
			if filepath.Dir(marker) != model {
				c.errorf("%s: waits for %s, which is not in KVMESH_MODEL=%s", where, marker, model)
			}
			for _, j := range c.r.Jobs {
				if cmd := j.Spec.Template.Spec.Containers[0].Command; cmd[len(cmd)-1] != marker {
					c.errorf("%s: waits for %s; Job/%s writes %s", where, marker, j.Name, cmd[len(cmd)-1])
				}
			}
			return
		}
	}
	if len(c.r.Jobs) > 0 {
		c.errorf("%s: loads %s from the cache the Job fills, without waiting for it", where, model)
	}
}

// Every KVMESH_* variable is the env twin of a flag this service defines; the
// required ones are set; the rest is from a short list of non-flag settings.
func (c *checker) envMatchesFlags(where, service string, ct corev1.Container) {
	defined := c.flags[service]
	for _, e := range ct.Env {
		if strings.HasPrefix(e.Name, "KVMESH_") {
			if _, ok := defined[e.Name]; !ok {
				c.errorf("%s: %s is not a flag of %s (docs/services.md)", where, e.Name, service)
			}
		} else if !slices.Contains(nonFlagEnv, e.Name) {
			c.errorf("%s: env %s is neither a flag's KVMESH_* twin nor one of %v", where, e.Name, nonFlagEnv)
		}
	}
	env := envMap(ct)
	for name, f := range defined {
		if _, ok := env[name]; f.Required && !ok {
			c.errorf("%s: %s is required by %s and not set", where, name, service)
		}
	}
	if len(ct.EnvFrom) > 0 {
		c.errorf("%s: envFrom hides which variables are set", where)
	}
}

func (c *checker) intEnv(where string, env map[string]corev1.EnvVar, name string) int {
	n, err := strconv.Atoi(env[name].Value)
	if err != nil {
		c.errorf("%s: %s=%q is not a number", where, name, env[name].Value)
	}
	return n
}

// On SIGTERM the service drains for KVMESH_GRACE_SECONDS after the preStop
// sleep: the pod's termination grace period must cover both, or SIGKILL cuts
// in-flight streams during a rolling update.
func (c *checker) drain(where string, spec corev1.PodSpec, ct corev1.Container, env map[string]corev1.EnvVar) {
	grace, err := strconv.ParseFloat(env["KVMESH_GRACE_SECONDS"].Value, 64)
	if err != nil {
		c.errorf("%s: KVMESH_GRACE_SECONDS=%q", where, env["KVMESH_GRACE_SECONDS"].Value)
		return
	}
	if ct.Lifecycle == nil || ct.Lifecycle.PreStop == nil || ct.Lifecycle.PreStop.Sleep == nil {
		c.errorf("%s: no preStop sleep", where)
		return
	}
	need := float64(ct.Lifecycle.PreStop.Sleep.Seconds) + grace
	if spec.TerminationGracePeriodSeconds == nil {
		c.errorf("%s: no terminationGracePeriodSeconds", where)
	} else if got := float64(*spec.TerminationGracePeriodSeconds); got <= need {
		c.errorf("%s: terminationGracePeriodSeconds %v does not exceed preStop + KVMESH_GRACE_SECONDS = %v", where, got, need)
	}
}

// Peers are found by Service DNS: each address is <Service>:<port> of a
// rendered Service that selects the right service's pods on their grpc port.
func (c *checker) addresses(where string, env map[string]corev1.EnvVar) {
	for name, want := range addressOf {
		e, ok := env[name]
		if !ok {
			continue
		}
		host, port, err := net.SplitHostPort(e.Value)
		if err != nil {
			c.errorf("%s: %s=%q is not host:port", where, name, e.Value)
			continue
		}
		if got := c.serviceTarget(host, port, "grpc"); got != want {
			c.errorf("%s: %s=%q reaches %q pods, want %s", where, name, e.Value, got, want)
		}
	}
	if e, ok := env["KVMESH_REDIS_URL"]; ok {
		u, err := url.Parse(e.Value)
		if err != nil || (u.Scheme != "redis" && u.Scheme != "rediss") || u.Port() == "" {
			c.errorf("%s: KVMESH_REDIS_URL=%q is not redis://host:port/db", where, e.Value)
			return
		}
		if c.podsLabelled("redis") && c.serviceTarget(u.Hostname(), u.Port(), "redis") != "redis" {
			c.errorf("%s: KVMESH_REDIS_URL=%q is not the rendered Redis Service", where, e.Value)
		}
	}
}

func (c *checker) podsLabelled(component string) bool {
	for _, w := range c.r.Workloads {
		if w.Template.Labels["app.kubernetes.io/component"] == component {
			return true
		}
	}
	return false
}

// serviceTarget: the component label of the pods Service `name` sends `port` to,
// when it reaches their container port called `portName`; "" otherwise.
func (c *checker) serviceTarget(name, port, portName string) string {
	for _, svc := range c.r.Services {
		if svc.Name != name {
			continue
		}
		for _, p := range svc.Spec.Ports {
			if strconv.Itoa(int(p.Port)) != port {
				continue
			}
			for _, w := range c.selected(svc.Spec.Selector) {
				for _, ct := range w.Template.Spec.Containers {
					if targetPortIs(p, ct, portName) {
						return w.Template.Labels["app.kubernetes.io/component"]
					}
				}
			}
		}
	}
	return ""
}

func targetPortIs(p corev1.ServicePort, ct corev1.Container, portName string) bool {
	want, ok := portNamed(ct, portName)
	if !ok {
		return false
	}
	switch p.TargetPort.Type {
	case intstr.String:
		return p.TargetPort.StrVal == portName
	default:
		return p.TargetPort.IntVal == want || (p.TargetPort.IntVal == 0 && p.Port == want)
	}
}

func (c *checker) selected(selector map[string]string) []Workload {
	var out []Workload
	if len(selector) == 0 {
		return nil
	}
	for _, w := range c.r.Workloads {
		if labels.SelectorFromSet(selector).Matches(labels.Set(w.Template.Labels)) {
			out = append(out, w)
		}
	}
	return out
}

// Whole GPUs from the device plugin, which never gives one GPU to two pods:
// only prefill and decode ask, requests equal limits, and nothing bypasses the
// plugin (visible-device variables, privileged containers, /dev mounts).
func (c *checker) gpus(wantGPU bool) {
	for _, w := range c.r.Workloads {
		where := w.Kind + "/" + w.Name
		s := component(w.Template)
		spec := w.Template.Spec
		asking := 0
		for _, ct := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
			limit, hasLimit := ct.Resources.Limits[gpuResource]
			request, hasRequest := ct.Resources.Requests[gpuResource]
			if hasRequest && (!hasLimit || request.Cmp(limit) != 0) {
				c.errorf("%s/%s: nvidia.com/gpu request %v is not its limit %v", where, ct.Name, request.String(), limit.String())
			}
			for _, e := range ct.Env {
				if e.Name == "NVIDIA_VISIBLE_DEVICES" || e.Name == "CUDA_VISIBLE_DEVICES" {
					c.errorf("%s/%s: %s picks GPUs behind the device plugin's back", where, ct.Name, e.Name)
				}
			}
			if ct.SecurityContext != nil && ct.SecurityContext.Privileged != nil && *ct.SecurityContext.Privileged {
				c.errorf("%s/%s: privileged containers see every GPU", where, ct.Name)
			}
			if !hasLimit {
				continue
			}
			asking++
			n, exact := limit.AsInt64()
			if !exact || n < 1 {
				c.errorf("%s/%s: nvidia.com/gpu %v is not a whole number of GPUs", where, ct.Name, limit.String())
			}
			if s != "prefill" && s != "decode" {
				c.errorf("%s/%s: only prefill and decode use GPUs", where, ct.Name)
			}
			device := envMap(ct)["KVMESH_DEVICE"].Value
			if idx, ok := strings.CutPrefix(device, "cuda:"); !ok {
				c.errorf("%s/%s: requests %d GPUs but KVMESH_DEVICE=%q", where, ct.Name, n, device)
			} else if i, err := strconv.Atoi(idx); err != nil || int64(i) >= n {
				c.errorf("%s/%s: KVMESH_DEVICE=%q is not one of the %d GPUs the pod sees", where, ct.Name, device, n)
			}
		}
		if asking > 1 {
			c.errorf("%s: %d containers of one pod request GPUs", where, asking)
		}
		for _, v := range spec.Volumes {
			if v.HostPath != nil && strings.HasPrefix(v.HostPath.Path, "/dev") {
				c.errorf("%s: hostPath %s bypasses the device plugin", where, v.HostPath.Path)
			}
		}
		if s == "prefill" || s == "decode" {
			ct := spec.Containers[0]
			_, hasGPU := ct.Resources.Limits[gpuResource]
			if wantGPU && !hasGPU {
				c.errorf("%s: %s requests no GPU", where, s)
			}
			if !hasGPU && envMap(ct)["KVMESH_DEVICE"].Value != "cpu" {
				c.errorf("%s: no GPU requested, so KVMESH_DEVICE must be cpu", where)
			}
		}
	}
}

// Every Service selects pods, on container ports that exist.
func (c *checker) serviceSelectors() {
	for _, svc := range c.r.Services {
		pods := c.selected(svc.Spec.Selector)
		if len(pods) == 0 {
			c.errorf("Service/%s selects no pods", svc.Name)
			continue
		}
		for _, p := range svc.Spec.Ports {
			if p.TargetPort.Type != intstr.String {
				continue
			}
			for _, w := range pods {
				found := false
				for _, ct := range w.Template.Spec.Containers {
					_, ok := portNamed(ct, p.TargetPort.StrVal)
					found = found || ok
				}
				if !found {
					c.errorf("Service/%s: targetPort %s is no container port of %s", svc.Name, p.TargetPort.StrVal, w.Name)
				}
			}
		}
	}
}

// Every PDB selects an existing workload's pods, and no pod has two PDBs
// (the eviction API refuses to evict those at all).
func (c *checker) pdbs() {
	covered := map[string]string{}
	for _, pdb := range c.r.PDBs {
		sel, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector)
		if err != nil || sel.Empty() {
			c.errorf("PodDisruptionBudget/%s: selector %v (%v)", pdb.Name, pdb.Spec.Selector, err)
			continue
		}
		n := 0
		for _, w := range c.r.Workloads {
			if sel.Matches(labels.Set(w.Template.Labels)) {
				n++
				if other, ok := covered[w.Name]; ok {
					c.errorf("%s/%s: selected by PodDisruptionBudgets %s and %s", w.Kind, w.Name, other, pdb.Name)
				}
				covered[w.Name] = pdb.Name
			}
		}
		if n == 0 {
			c.errorf("PodDisruptionBudget/%s selects no pods", pdb.Name)
		}
		if pdb.Spec.MinAvailable == nil && pdb.Spec.MaxUnavailable == nil {
			c.errorf("PodDisruptionBudget/%s: neither minAvailable nor maxUnavailable", pdb.Name)
		}
	}
}

// An HPA scales a rendered workload that leaves replicas to it, on per-pod
// metrics, scaling down slowly (a new pod spends minutes loading the model).
func (c *checker) hpas() {
	for _, h := range c.r.HPAs {
		where := "HorizontalPodAutoscaler/" + h.Name
		var target *Workload
		for i, w := range c.r.Workloads {
			if w.Kind == h.Spec.ScaleTargetRef.Kind && w.Name == h.Spec.ScaleTargetRef.Name {
				target = &c.r.Workloads[i]
			}
		}
		if target == nil {
			c.errorf("%s: scales %s/%s, which is not rendered", where, h.Spec.ScaleTargetRef.Kind, h.Spec.ScaleTargetRef.Name)
			continue
		}
		if s := component(target.Template); s != "prefill" && s != "decode" {
			c.errorf("%s: scales %s; only prefill and decode autoscale", where, s)
		}
		if target.Replicas != nil {
			c.errorf("%s: %s also sets replicas, so every helm upgrade resets the HPA's count", where, target.Name)
		}
		if len(h.Spec.Metrics) == 0 {
			c.errorf("%s: no metrics", where)
		}
		for _, m := range h.Spec.Metrics {
			if m.Type != "Pods" || m.Pods == nil || !strings.HasPrefix(m.Pods.Metric.Name, "kvmesh_") {
				c.errorf("%s: metric %+v is not a per-pod kvmesh_* metric", where, m)
			}
		}
		if b := h.Spec.Behavior; b == nil || b.ScaleDown == nil || b.ScaleDown.StabilizationWindowSeconds == nil ||
			*b.ScaleDown.StabilizationWindowSeconds < 300 {
			c.errorf("%s: scale-down stabilization under 300s", where)
		}
	}
	// The two scale separately: one HPA each at most.
	seen := map[string]bool{}
	for _, h := range c.r.HPAs {
		if seen[h.Spec.ScaleTargetRef.Name] {
			c.errorf("two HPAs scale %s", h.Spec.ScaleTargetRef.Name)
		}
		seen[h.Spec.ScaleTargetRef.Name] = true
	}
}

// A ServiceMonitor scrapes every kvmesh service's metrics port.
func (c *checker) serviceMonitors() {
	for _, sm := range c.r.Monitors {
		where := "ServiceMonitor/" + sm.Name
		sel, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
		if err != nil || sel.Empty() {
			c.errorf("%s: selector (%v)", where, err)
			continue
		}
		scraped := map[string]bool{}
		for _, svc := range c.r.Services {
			if !sel.Matches(labels.Set(svc.Labels)) {
				continue
			}
			for _, ep := range sm.Spec.Endpoints {
				hasPort := slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == ep.Port })
				if !hasPort {
					c.errorf("%s: Service/%s has no port %q", where, svc.Name, ep.Port)
				}
			}
			for _, w := range c.selected(svc.Spec.Selector) {
				scraped[component(w.Template)] = true
			}
		}
		for _, s := range services {
			if !scraped[s] {
				c.errorf("%s: does not scrape %s", where, s)
			}
		}
	}
}

// The model cache: kvmesh services mount it read-only; the claim they mount is rendered or named as existing.
func (c *checker) modelCache() {
	claims := map[string]bool{}
	for _, pvc := range c.r.Claims {
		claims[pvc.Name] = true
	}
	for _, w := range c.r.Workloads {
		if component(w.Template) == "" {
			continue
		}
		for _, v := range w.Template.Spec.Volumes {
			if v.PersistentVolumeClaim == nil {
				continue
			}
			if !v.PersistentVolumeClaim.ReadOnly {
				c.errorf("%s/%s: claim %s is mounted writable", w.Kind, w.Name, v.PersistentVolumeClaim.ClaimName)
			}
			for _, ct := range w.Template.Spec.Containers {
				for _, m := range ct.VolumeMounts {
					if m.Name == v.Name && !m.ReadOnly {
						c.errorf("%s/%s: %s mounts the model cache writable", w.Kind, w.Name, ct.Name)
					}
				}
			}
		}
	}
	for _, j := range c.r.Jobs {
		for _, v := range j.Spec.Template.Spec.Volumes {
			if pvc := v.PersistentVolumeClaim; pvc != nil && !claims[pvc.ClaimName] {
				c.errorf("Job/%s fills claim %s, which is not rendered", j.Name, pvc.ClaimName)
			}
		}
	}
}
