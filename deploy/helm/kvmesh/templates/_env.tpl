{{/*
Each service's environment: the KVMESH_* twins of its flags (docs/services.md),
as compose/docker-compose.yml sets them. Peers are Service DNS names
(kvmesh.address). tests/deploy/ checks every KVMESH_* name against the flags
the service defines.
*/}}

{{/* Argument: (list $ "router"). The flags every service has, then `env:` from values. */}}
{{- define "kvmesh.env.common" -}}
{{- $root := index . 0 -}}{{- $c := index . 1 -}}{{- $v := index $root.Values $c -}}
- name: KVMESH_HOST
  value: {{ $root.Values.common.bindHost | quote }}
- name: KVMESH_PORT
  value: {{ $v.port | quote }}
- name: KVMESH_METRICS_PORT
  value: {{ $v.metricsPort | quote }}
- name: KVMESH_LOG_LEVEL
  value: {{ $root.Values.common.logLevel | quote }}
- name: KVMESH_GRACE_SECONDS
  value: {{ include "kvmesh.graceSeconds" . | quote }}
- name: PYTHONUNBUFFERED
  value: "1"
{{- if $root.Values.tls.enabled }}
# Mutual TLS: this role's own Secret (templates/tls.yaml), reloaded by the service when it rotates.
- name: KVMESH_TLS_CA
  value: /etc/kvmesh/tls/ca.crt
- name: KVMESH_TLS_CERT
  value: /etc/kvmesh/tls/tls.crt
- name: KVMESH_TLS_KEY
  value: /etc/kvmesh/tls/tls.key
{{- end }}
{{- with $root.Values.tracing }}{{ if .enabled }}
# Traces (templates/jaeger.yaml): this service's spans over OTLP/gRPC.
- name: KVMESH_OTLP_ENDPOINT
  value: {{ .endpoint | default (printf "http://%s:4317" (include "kvmesh.name" (list $root "jaeger"))) | quote }}
- name: KVMESH_TRACE_SAMPLE_RATIO
  value: {{ .sampleRatio | quote }}
{{- end }}{{ end }}
{{- /* No OMP_WAIT_POLICY=PASSIVE: sleeping OpenMP threads pay a wake-up on every parallel op of a step (compose/docker-compose.yml). */}}
{{- end -}}

{{/* Workers register with the router under an address others dial: the pod IP. */}}
{{- define "kvmesh.env.advertise" -}}
{{- $root := index . 0 -}}{{- $c := index . 1 -}}
- name: POD_IP
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
- name: KVMESH_ADVERTISE_ADDRESS
  value: "$(POD_IP):{{ (index $root.Values $c).port }}"
{{- end -}}

{{- define "kvmesh.env.model" -}}
- name: KVMESH_MODEL
  value: {{ include "kvmesh.modelDir" . | quote }}
{{- end -}}

{{/* Argument: (list $ "prefill"). What prefill and decode share: the engine's settings. */}}
{{- define "kvmesh.env.worker" -}}
{{- $root := index . 0 -}}{{- $c := index . 1 -}}{{- $v := index $root.Values $c -}}
- name: KVMESH_ROUTER_ADDRESS
  value: {{ include "kvmesh.address" (list $root "router") | quote }}
- name: KVMESH_KVSTORE_ADDRESS
  value: {{ include "kvmesh.address" (list $root "kvstore") | quote }}
{{ include "kvmesh.env.model" $root }}
# The pod sees only the GPUs it requested (kvmesh.gpus: a GPU per rank), as cuda:0..N-1; rank r runs on cuda:r.
- name: KVMESH_DEVICE
  value: {{ ternary "cuda:0" "cpu" (gt (int $v.gpus) 0) | quote }}
- name: KVMESH_NUM_BLOCKS
  value: {{ $v.numBlocks | quote }}
# The worker's engine split over this many rank processes of this pod (workersPerReplica; docs/tensor_parallel.md).
- name: KVMESH_TENSOR_PARALLEL_SIZE
  value: {{ include "kvmesh.tensorParallelSize" . | quote }}
{{- with $v.maxModelLen }}
- name: KVMESH_MAX_MODEL_LEN
  value: {{ . | quote }}
{{- end }}
{{ include "kvmesh.env.advertise" . }}
{{- end -}}

{{/*
Argument: (list $ "decode"). The tensor-parallel degree of the service's one worker per pod:
workersPerReplica, its ranks being processes of that pod. On a GPU (gpus > 0) rank r runs on the
pod's cuda:r, a GPU per rank (kvmesh.gpus). On the CPU the ranks share the pod's cores equally,
so the pod requests at least a core a rank.
*/}}
{{- define "kvmesh.tensorParallelSize" -}}
{{- $root := index . 0 -}}{{- $c := index . 1 -}}{{- $v := index $root.Values $c -}}
{{- $n := int $v.workersPerReplica -}}
{{- if and (gt $n 1) (eq (int (include "kvmesh.gpus" .)) 0) -}}
{{- $cpu := (($v.resources | default dict).requests | default dict).cpu -}}
{{- if $cpu -}}
{{- $text := toString $cpu -}}
{{- $cores := float64 $text -}}
{{- if hasSuffix "m" $text -}}{{- $cores = divf (float64 (trimSuffix "m" $text)) 1000 -}}{{- end -}}
{{- if lt $cores (float64 $n) -}}
{{- fail (printf "%s.workersPerReplica %d: %s.resources.requests.cpu %s is less than a core a rank (at least %d)" $c $n $c $text $n) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{/*
Argument: (list $ "decode"). The nvidia.com/gpu a pod of the service requests (and limits): 0 on
the CPU (gpus: 0, and every service but prefill and decode), else a GPU per rank of its worker,
workersPerReplica of them, which the pod sees as cuda:0..N-1 (rank r on cuda:r; the engine refuses
to start on fewer). gpus says CPU or GPU: 0, or 1 (a GPU per rank), or workersPerReplica itself
(the same pod, counted per pod); any other count is refused, since no rank would use the extra
GPUs and too few fail the worker at start.
*/}}
{{- define "kvmesh.gpus" -}}
{{- $root := index . 0 -}}{{- $c := index . 1 -}}{{- $v := index $root.Values $c -}}
{{- $gpus := int ($v.gpus | default 0) -}}
{{- $n := int ($v.workersPerReplica | default 1) -}}
{{- if and (gt $gpus 1) (ne $gpus $n) -}}
{{- $why := ternary "the extra GPUs would sit idle" "the engine refuses to start on fewer GPUs than ranks" (gt $gpus $n) -}}
{{- $perPod := ternary "" (printf ", or %d, the same counted per pod" $n) (eq $n 1) -}}
{{- fail (printf "%s.gpus %d does not fit %s.workersPerReplica %d: a pod gets a GPU per rank, so gpus is 0 (the CPU) or 1 (a GPU per rank: %d nvidia.com/gpu a pod)%s; rank r runs on the pod's cuda:r and %s" $c $gpus $c $n $n $perPod $why) -}}
{{- end -}}
{{- ternary $n 0 (gt $gpus 0) -}}
{{- end -}}

{{- define "kvmesh.env.router" -}}
{{ include "kvmesh.env.redis" . }}
{{- end -}}

{{/* The router's prefix index and the gateway's stored responses (/v1/responses): one Redis. */}}
{{- define "kvmesh.env.redis" -}}
- name: KVMESH_REDIS_URL
  value: {{ include "kvmesh.redisUrl" . | quote }}
{{- if .Values.redis.enabled }}
# The subchart's Redis password (its <release>-redis-auth Secret), mounted by the workload.
- name: KVMESH_REDIS_PASSWORD_FILE
  value: /etc/kvmesh/redis/password
{{- end }}
{{- end -}}

{{- define "kvmesh.env.kvstore" -}}
- name: KVMESH_ROUTER_ADDRESS
  value: {{ include "kvmesh.address" (list . "router") | quote }}
# A StatefulSet pod's name is stable: the same worker id after a restart, with the same disk.
- name: KVMESH_WORKER_ID
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
- name: KVMESH_RAM_BUDGET_BYTES
  value: {{ .Values.kvstore.ramBudgetBytes | int64 | quote }}
{{- if .Values.kvstore.disk.enabled }}
- name: KVMESH_DISK_DIR
  value: /var/lib/kvmesh/kvstore
- name: KVMESH_DISK_BUDGET_BYTES
  value: {{ .Values.kvstore.disk.budgetBytes | int64 | quote }}
{{- end }}
{{ include "kvmesh.env.advertise" (list . "kvstore") }}
{{- end -}}

{{- define "kvmesh.env.speculator" -}}
{{- end -}}

{{- define "kvmesh.env.prefill" -}}
{{ include "kvmesh.env.worker" (list . "prefill") }}
{{- end -}}

{{- define "kvmesh.env.decode" -}}
{{ include "kvmesh.env.worker" (list . "decode") }}
- name: KVMESH_SPECULATOR_ADDRESS
  value: {{ include "kvmesh.address" (list . "speculator") | quote }}
- name: KVMESH_NUM_SPECULATIVE_TOKENS
  value: {{ .Values.decode.numSpeculativeTokens | quote }}
{{- end -}}

{{- define "kvmesh.env.gateway" -}}
- name: KVMESH_ROUTER_ADDRESS
  value: {{ include "kvmesh.address" (list . "router") | quote }}
{{ include "kvmesh.env.model" . }}
- name: KVMESH_MODEL_NAME
  value: {{ .Values.model.name | quote }}
- name: KVMESH_HTTP_PORT
  value: {{ .Values.gateway.httpPort | quote }}
{{ include "kvmesh.env.redis" . }}
{{- if .Values.gateway.apiKeys.enabled }}
- name: KVMESH_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.apiKeysSecret" . }}
      key: {{ .Values.gateway.apiKeys.secretKey }}
{{- end }}
{{- end -}}

{{/* Argument: (list $ "decode"). The service's own grace period, else the common one. */}}
{{- define "kvmesh.graceSeconds" -}}
{{- $root := index . 0 -}}{{- $v := index $root.Values (index . 1) -}}
{{- $v.graceSeconds | default $root.Values.common.graceSeconds -}}
{{- end -}}
