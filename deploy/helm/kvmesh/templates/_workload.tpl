{{/*
One kvmesh service's workload: a Deployment (a StatefulSet for the kvstore,
whose replicas own their disk tier). Argument: (list $ "decode").
Every container is probed at GET /healthz on its metrics port (a kubelet gRPC
probe cannot present the client certificate mutual TLS asks for): 503 while the
model loads (the startupProbe waits up to startupSeconds) and while draining
(readiness drops at SIGTERM, so Service endpoints let go first).
*/}}
{{- define "kvmesh.workload" -}}
{{- $root := index . 0 -}}{{- $c := index . 1 -}}{{- $v := index $root.Values $c -}}
{{- $usesModel := has $c (list "prefill" "decode" "gateway") -}}
{{- /* A GPU per tensor-parallel rank (kvmesh.gpus), 0 on the CPU; refuses a count no rank would use. */ -}}
{{- $gpus := int (include "kvmesh.gpus" .) -}}
{{- /* NCCL between a pod's GPU ranks goes through /dev/shm, 64Mi by default in a container. */ -}}
{{- $ncclShm := gt $gpus 1 -}}
{{- $stateful := eq $c "kvstore" -}}
{{- /* The router's index and the gateway's stored responses are in the subchart's Redis. */ -}}
{{- $redisAuth := and (has $c (list "router" "gateway")) $root.Values.redis.enabled -}}
{{- $autoscaled := and $v.autoscaling $v.autoscaling.enabled -}}
{{- $grace := int (include "kvmesh.graceSeconds" .) -}}
{{- $preStop := int $root.Values.common.preStopSeconds -}}
apiVersion: apps/v1
kind: {{ ternary "StatefulSet" "Deployment" $stateful }}
metadata:
  name: {{ include "kvmesh.name" . }}
  labels:
    {{- include "kvmesh.labels" . | nindent 4 }}
spec:
  {{- if not $autoscaled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "kvmesh.selectorLabels" . | nindent 6 }}
  {{- if $stateful }}
  serviceName: {{ include "kvmesh.name" . }}
  podManagementPolicy: Parallel
  {{- else if $v.strategy }}
  strategy:
    {{- toYaml $v.strategy | nindent 4 }}
  {{- end }}
  template:
    metadata:
      labels:
        {{- include "kvmesh.labels" . | nindent 8 }}
      {{- with $root.Values.common.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      terminationGracePeriodSeconds: {{ add $preStop $grace 15 }}
      securityContext:
        {{- toYaml $root.Values.common.podSecurityContext | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $root.Values.common.topologySpread.enabled }}
      topologySpreadConstraints:
        - maxSkew: 1
          topologyKey: {{ $root.Values.common.topologySpread.topologyKey }}
          whenUnsatisfiable: {{ $root.Values.common.topologySpread.whenUnsatisfiable }}
          labelSelector:
            matchLabels:
              {{- include "kvmesh.selectorLabels" . | nindent 14 }}
      {{- end }}
      {{- if and $usesModel (include "kvmesh.waitsForModel" $root) }}
      initContainers:
        # The model-init Job fills the cache once; until it has, there is nothing to load.
        - name: wait-for-model
          image: {{ include "kvmesh.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["sh", "-c", "until [ -f \"$0\" ]; do echo \"waiting for $0 (the model-init Job)\"; sleep 10; done", {{ include "kvmesh.modelReady" $root | quote }}]
          resources:
            requests: {cpu: 10m, memory: 16Mi}
            limits: {memory: 64Mi}
          volumeMounts:
            - name: model
              mountPath: {{ $root.Values.model.cache.mountPath }}
              readOnly: true
      {{- end }}
      containers:
        - name: {{ $c }}
          image: {{ include "kvmesh.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args: [{{ $c | quote }}]
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
            - name: metrics
              containerPort: {{ $v.metricsPort }}
            {{- if eq $c "gateway" }}
            - name: http
              containerPort: {{ $v.httpPort }}
            {{- end }}
          {{- $env := printf "%s\n%s" (include "kvmesh.env.common" .) (include (printf "kvmesh.env.%s" $c) $root) }}
          {{- range $e := fromYamlArray $env }}
          {{- if hasKey $v.env $e.name }}
          {{- fail (printf "%s.env.%s: the chart sets %s itself; use the value that sets it" $c $e.name $e.name) }}
          {{- end }}
          {{- end }}
          env:
            {{- $env | nindent 12 }}
            {{- range $name, $value := $v.env }}
            - name: {{ $name }}
              value: {{ $value | toString | quote }}
            {{- end }}
          startupProbe:
            httpGet: {path: /healthz, port: metrics}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: {{ max 1 (div (add $v.startupSeconds 9) 10) }}
          readinessProbe:
            httpGet: {path: /healthz, port: metrics}
            periodSeconds: 5
            timeoutSeconds: 5
            failureThreshold: 2
          livenessProbe:
            httpGet: {path: /healthz, port: metrics}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 3
          lifecycle:
            preStop:
              sleep: {seconds: {{ $preStop }}}
          resources:
            {{- $res := deepCopy ($v.resources | default dict) }}
            {{- if gt $gpus 0 }}
            {{- $limits := merge (dict "nvidia.com/gpu" $gpus) ($res.limits | default dict) }}
            {{- $requests := merge (dict "nvidia.com/gpu" $gpus) ($res.requests | default dict) }}
            {{- $_ := set $res "limits" $limits }}
            {{- $_ := set $res "requests" $requests }}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          {{- if or $usesModel (and $stateful $v.disk.enabled) $root.Values.tls.enabled $redisAuth }}
          volumeMounts:
            {{- if $redisAuth }}
            - name: redis-auth
              mountPath: /etc/kvmesh/redis
              readOnly: true
            {{- end }}
            {{- if $root.Values.tls.enabled }}
            - name: tls
              mountPath: /etc/kvmesh/tls
              readOnly: true
            {{- end }}
            {{- if and $usesModel (eq $root.Values.model.source "cache") }}
            - name: model
              mountPath: {{ $root.Values.model.cache.mountPath }}
              readOnly: true
            {{- end }}
            {{- if and $stateful $v.disk.enabled }}
            - name: disk
              mountPath: /var/lib/kvmesh/kvstore
            {{- end }}
            {{- if $ncclShm }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
          {{- end }}
      {{- if or (and $usesModel (eq $root.Values.model.source "cache")) $root.Values.tls.enabled $redisAuth $ncclShm }}
      volumes:
        {{- if $redisAuth }}
        - name: redis-auth
          secret:
            secretName: {{ printf "%s-auth" (printf "%s-redis" $root.Release.Name | trunc 63 | trimSuffix "-") }}
            defaultMode: 0440  # the kvmesh user reads it through fsGroup
        {{- end }}
        {{- if and $usesModel (eq $root.Values.model.source "cache") }}
        - name: model
          persistentVolumeClaim:
            claimName: {{ include "kvmesh.modelClaim" $root }}
            readOnly: true
        {{- end }}
        {{- if $root.Values.tls.enabled }}
        # Not a subPath mount: the kubelet swaps a renewed Secret in place and the service reloads it.
        - name: tls
          secret:
            secretName: {{ include "kvmesh.tls.secret" . }}
            defaultMode: 0440  # the kvmesh user reads it through fsGroup
        {{- end }}
        {{- if $ncclShm }}
        # NCCL's shared-memory segments between the ranks (RAM, counted against the memory limit).
        - name: dshm
          emptyDir: {medium: Memory, sizeLimit: 1Gi}
        {{- end }}
      {{- end }}
  {{- if and $stateful $v.disk.enabled }}
  volumeClaimTemplates:
    - metadata:
        name: disk
      spec:
        accessModes: ["ReadWriteOnce"]
        {{- with $v.disk.storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $v.disk.size }}
  {{- end }}
{{- end -}}
