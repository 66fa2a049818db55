package validate

// Checks of one workload's pod template: the model mount, its environment against the service's flags,
// drain settings, the addresses it dials, and the Services that select it. Methods of chart_test.go's checker.

import (
	"net"
	"net/url"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

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
