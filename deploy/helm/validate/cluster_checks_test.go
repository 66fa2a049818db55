package validate

// Checks across workloads: GPU requests, Service selectors, PodDisruptionBudgets, autoscalers,
// ServiceMonitors and the model cache. Each is a method of the checker in chart_test.go.

import (
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

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
			c.tensorParallel(where, spec, ct, hasGPU)
		}
	}
}

// A worker split over KVMESH_TENSOR_PARALLEL_SIZE ranks runs them as processes of its one pod:
// with GPUs, a GPU per rank (rank r on the pod's cuda:r, from KVMESH_DEVICE cuda:0; the engine refuses
// to start on fewer, and more would sit idle), so the nvidia.com/gpu limit is the rank count; on the
// CPU, each rank with at least a core of the pod's CPU request. GPU ranks reach each other through
// NCCL, whose segments in /dev/shm outgrow a container's default 64Mi: a memory emptyDir there.
func (c *checker) tensorParallel(where string, spec corev1.PodSpec, ct corev1.Container, hasGPU bool) {
	env := envMap(ct)
	if _, ok := env["KVMESH_TENSOR_PARALLEL_SIZE"]; !ok {
		c.errorf("%s: KVMESH_TENSOR_PARALLEL_SIZE is not set (workersPerReplica)", where)
		return
	}
	ranks := c.intEnv(where, env, "KVMESH_TENSOR_PARALLEL_SIZE")
	if ranks < 1 {
		c.errorf("%s: KVMESH_TENSOR_PARALLEL_SIZE=%d", where, ranks)
		return
	}
	if hasGPU {
		limit := ct.Resources.Limits[gpuResource]
		if n, exact := limit.AsInt64(); !exact || n != int64(ranks) {
			c.errorf("%s: nvidia.com/gpu %s for %d tensor-parallel ranks: a GPU per rank", where, limit.String(), ranks)
		}
		if device := env["KVMESH_DEVICE"].Value; device != "cuda:0" {
			c.errorf("%s: KVMESH_DEVICE=%q: the ranks run on cuda:0..%d, the pod's GPUs from the first", where, device, ranks-1)
		}
		if ranks > 1 && !memoryAt(spec, ct, "/dev/shm") {
			c.errorf("%s: %d GPU ranks without a memory emptyDir at /dev/shm (NCCL's shared memory)", where, ranks)
		}
		return
	}
	if cpu, ok := ct.Resources.Requests[corev1.ResourceCPU]; ok && ranks > 1 && cpu.MilliValue() < int64(ranks)*1000 {
		c.errorf("%s: %d tensor-parallel ranks on a CPU request of %s: less than a core a rank", where, ranks, cpu.String())
	}
}

// Whether ct mounts a memory-backed emptyDir of spec at path.
func memoryAt(spec corev1.PodSpec, ct corev1.Container, path string) bool {
	for _, m := range ct.VolumeMounts {
		if m.MountPath != path {
			continue
		}
		for _, v := range spec.Volumes {
			if v.Name == m.Name && v.EmptyDir != nil && v.EmptyDir.Medium == corev1.StorageMediumMemory {
				return true
			}
		}
	}
	return false
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

// scaledTarget is the rendered workload kind/name that an autoscaler (where) scales, checked
// to be a prefill or decode one that leaves replicas to the autoscaler (counter: whose count a helm
// upgrade would reset); nil, reported, when no such workload is rendered.
func (c *checker) scaledTarget(where, kind, name, counter string) *Workload {
	var target *Workload
	for i, w := range c.r.Workloads {
		if w.Kind == kind && w.Name == name {
			target = &c.r.Workloads[i]
		}
	}
	if target == nil {
		c.errorf("%s: scales %s/%s, which is not rendered", where, kind, name)
		return nil
	}
	if k := component(target.Template); k != "prefill" && k != "decode" {
		c.errorf("%s: scales %s; only prefill and decode autoscale", where, k)
	}
	if target.Replicas != nil {
		c.errorf("%s: %s also sets replicas, so every helm upgrade resets %s count", where, target.Name, counter)
	}
	return target
}

// An HPA scales a rendered workload that leaves replicas to it, on per-pod
// metrics, scaling down slowly (a new pod spends minutes loading the model).
func (c *checker) hpas() {
	for _, h := range c.r.HPAs {
		where := "HorizontalPodAutoscaler/" + h.Name
		ref := h.Spec.ScaleTargetRef
		if c.scaledTarget(where, ref.Kind, ref.Name, "the HPA's") == nil {
			continue
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
