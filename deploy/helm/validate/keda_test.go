package validate

import (
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ScaledObject is KEDA's (keda.sh/v1alpha1), as far as the chart renders it. KEDA's own Go module
// would pull in its whole operator; kubectl-validate checks the rendered objects against KEDA's CRD
// (tests/deploy/test_helm_chart.py), so this type only has to decode them strictly for the invariants.
type ScaledObject struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              ScaledObjectSpec `json:"spec"`
}

type ScaledObjectSpec struct {
	ScaleTargetRef  ScaleTarget   `json:"scaleTargetRef"`
	MinReplicaCount *int32        `json:"minReplicaCount,omitempty"`
	MaxReplicaCount *int32        `json:"maxReplicaCount,omitempty"`
	Advanced        *KedaAdvanced `json:"advanced,omitempty"`
	Triggers        []KedaTrigger `json:"triggers"`
}

type ScaleTarget struct {
	APIVersion string `json:"apiVersion,omitempty"`
	Kind       string `json:"kind,omitempty"`
	Name       string `json:"name"`
}

type KedaAdvanced struct {
	HorizontalPodAutoscalerConfig *struct {
		Behavior *autoscalingv2.HorizontalPodAutoscalerBehavior `json:"behavior,omitempty"`
	} `json:"horizontalPodAutoscalerConfig,omitempty"`
}

type KedaTrigger struct {
	Type       string            `json:"type"`
	MetricType string            `json:"metricType,omitempty"`
	Metadata   map[string]string `json:"metadata"`
}

// A ScaledObject scales a rendered prefill or decode workload that leaves replicas to it, on a
// Prometheus query, scaling down slowly; no HPA of the chart's own scales the same workload.
func (c *checker) scaledObjects() {
	hpa := map[string]bool{}
	for _, h := range c.r.HPAs {
		hpa[h.Spec.ScaleTargetRef.Name] = true
	}
	for _, s := range c.r.ScaledObjects {
		where := "ScaledObject/" + s.Name
		ref := s.Spec.ScaleTargetRef
		target := c.scaledTarget(where, ref.Kind, ref.Name, "KEDA's")
		if target == nil {
			continue
		}
		if hpa[target.Name] {
			c.errorf("%s: an HPA of the chart's also scales %s", where, target.Name)
		}
		if len(s.Spec.Triggers) == 0 {
			c.errorf("%s: no triggers", where)
		}
		for _, t := range s.Spec.Triggers {
			if t.Type != "prometheus" || t.Metadata["serverAddress"] == "" || t.Metadata["query"] == "" ||
				t.Metadata["threshold"] == "" {
				c.errorf("%s: trigger %+v is not a whole Prometheus query", where, t)
			}
		}
		a := s.Spec.Advanced
		if a == nil || a.HorizontalPodAutoscalerConfig == nil || a.HorizontalPodAutoscalerConfig.Behavior == nil ||
			a.HorizontalPodAutoscalerConfig.Behavior.ScaleDown == nil ||
			a.HorizontalPodAutoscalerConfig.Behavior.ScaleDown.StabilizationWindowSeconds == nil ||
			*a.HorizontalPodAutoscalerConfig.Behavior.ScaleDown.StabilizationWindowSeconds < 300 {
			c.errorf("%s: scale-down stabilization under 300s", where)
		}
	}
}
