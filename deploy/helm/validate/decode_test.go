package validate

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// newObject maps each apiVersion/kind the chart may render to its real Go type.
// Anything else is an error: a kind the chart starts rendering must be added here,
// with the invariants it needs.
var newObject = map[string]func() any{
	"v1/Service":                    func() any { return &corev1.Service{} },
	"v1/ConfigMap":                  func() any { return &corev1.ConfigMap{} },
	"v1/Secret":                     func() any { return &corev1.Secret{} },
	"v1/PersistentVolumeClaim":      func() any { return &corev1.PersistentVolumeClaim{} },
	"apps/v1/Deployment":            func() any { return &appsv1.Deployment{} },
	"apps/v1/StatefulSet":           func() any { return &appsv1.StatefulSet{} },
	"batch/v1/Job":                  func() any { return &batchv1.Job{} },
	"policy/v1/PodDisruptionBudget": func() any { return &policyv1.PodDisruptionBudget{} },
	"autoscaling/v2/HorizontalPodAutoscaler": func() any {
		return &autoscalingv2.HorizontalPodAutoscaler{}
	},
	"monitoring.coreos.com/v1/ServiceMonitor": func() any { return &monitoringv1.ServiceMonitor{} },
	"networking.k8s.io/v1/NetworkPolicy":      func() any { return &networkingv1.NetworkPolicy{} },
	"keda.sh/v1alpha1/ScaledObject":           func() any { return &ScaledObject{} },
}

// Object is one rendered manifest, decoded.
type Object struct {
	Key    string // "Kind/name"
	Source string // helm's "# Source:" line
	Value  any    // *corev1.Service, *appsv1.Deployment, ...
}

// Render is one `helm template` output: every object, by kind.
type Render struct {
	Objects    []Object
	Services   []*corev1.Service
	ConfigMaps []*corev1.ConfigMap
	Secrets    []*corev1.Secret
	Claims     []*corev1.PersistentVolumeClaim
	Workloads  []Workload
	Jobs       []*batchv1.Job
	PDBs       []*policyv1.PodDisruptionBudget
	HPAs       []*autoscalingv2.HorizontalPodAutoscaler
	Monitors   []*monitoringv1.ServiceMonitor
	Policies   []*networkingv1.NetworkPolicy
	// KEDA's, instead of an HPA (keda_test.go).
	ScaledObjects []*ScaledObject
}

// Workload is a Deployment or a StatefulSet: what owns long-running pods.
type Workload struct {
	Kind        string
	Name        string
	Replicas    *int32
	Selector    *metav1.LabelSelector
	Template    corev1.PodTemplateSpec
	ServiceName string // a StatefulSet's governing Service
}

// decodeFile splits a multi-document YAML file and decodes each document strictly:
// an unknown field, a wrong type or a duplicate key is an error.
func decodeFile(path string) (*Render, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	r := &Render{}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		source := sourceOf(doc)
		var meta metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			return nil, fmt.Errorf("%s: %w", source, err)
		}
		if meta.Kind == "" {
			if len(bytes.TrimSpace(stripComments(doc))) == 0 {
				continue // an empty document (a template that rendered nothing)
			}
			return nil, fmt.Errorf("%s: a document without kind", source)
		}
		gvk := meta.APIVersion + "/" + meta.Kind
		ctor, ok := newObject[gvk]
		if !ok {
			return nil, fmt.Errorf("%s: %s is not a kind this test knows (add it to newObject, with its invariants)", source, gvk)
		}
		obj := ctor()
		if err := yaml.UnmarshalStrict(doc, obj); err != nil {
			return nil, fmt.Errorf("%s (%s): %w", source, gvk, err)
		}
		r.add(source, obj)
	}
	return r, nil
}

func (r *Render) add(source string, obj any) {
	var name, kind string
	switch o := obj.(type) {
	case *corev1.Service:
		r.Services, kind, name = append(r.Services, o), "Service", o.Name
	case *corev1.ConfigMap:
		r.ConfigMaps, kind, name = append(r.ConfigMaps, o), "ConfigMap", o.Name
	case *corev1.Secret:
		r.Secrets, kind, name = append(r.Secrets, o), "Secret", o.Name
	case *corev1.PersistentVolumeClaim:
		r.Claims, kind, name = append(r.Claims, o), "PersistentVolumeClaim", o.Name
	case *appsv1.Deployment:
		r.Workloads = append(r.Workloads, Workload{"Deployment", o.Name, o.Spec.Replicas, o.Spec.Selector, o.Spec.Template, ""})
		kind, name = "Deployment", o.Name
	case *appsv1.StatefulSet:
		r.Workloads = append(r.Workloads, Workload{"StatefulSet", o.Name, o.Spec.Replicas, o.Spec.Selector, o.Spec.Template, o.Spec.ServiceName})
		kind, name = "StatefulSet", o.Name
	case *batchv1.Job:
		r.Jobs, kind, name = append(r.Jobs, o), "Job", o.Name
	case *policyv1.PodDisruptionBudget:
		r.PDBs, kind, name = append(r.PDBs, o), "PodDisruptionBudget", o.Name
	case *autoscalingv2.HorizontalPodAutoscaler:
		r.HPAs, kind, name = append(r.HPAs, o), "HorizontalPodAutoscaler", o.Name
	case *monitoringv1.ServiceMonitor:
		r.Monitors, kind, name = append(r.Monitors, o), "ServiceMonitor", o.Name
	case *networkingv1.NetworkPolicy:
		r.Policies, kind, name = append(r.Policies, o), "NetworkPolicy", o.Name
	case *ScaledObject:
		r.ScaledObjects, kind, name = append(r.ScaledObjects, o), "ScaledObject", o.Name
	}
	r.Objects = append(r.Objects, Object{Key: kind + "/" + name, Source: source, Value: obj})
}

func sourceOf(doc []byte) string {
	for _, line := range strings.Split(string(doc), "\n") {
		if s, ok := strings.CutPrefix(line, "# Source: "); ok {
			return s
		}
	}
	return "(no # Source: line)"
}

func stripComments(doc []byte) []byte {
	var out []string
	for _, line := range strings.Split(string(doc), "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			out = append(out, line)
		}
	}
	return []byte(strings.Join(out, "\n"))
}

// renderedCases lists dir's *.yaml files: one `helm template` output per values case.
func renderedCases(dir string) ([]string, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	sort.Strings(paths)
	return paths, err
}
