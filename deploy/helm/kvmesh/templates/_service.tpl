{{/*
A service's Service: its DNS name is the address the others dial
(kvmesh.address), and the ServiceMonitor scrapes its `metrics` port.
Workers (prefill, decode, kvstore) are dialled at the pod IP they register
with the router, so theirs are headless: DNS and metrics only.
Argument: (list $ "router").
*/}}
{{- define "kvmesh.service" -}}
{{- $root := index . 0 -}}{{- $c := index . 1 -}}{{- $v := index $root.Values $c -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "kvmesh.name" . }}
  labels:
    {{- include "kvmesh.labels" . | nindent 4 }}
    kvmesh.dev/metrics: "true"
  {{- with (and (eq $c "gateway") $v.service.annotations) }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if has $c (list "prefill" "decode" "kvstore") }}
  clusterIP: None
  {{- else if eq $c "gateway" }}
  type: {{ $v.service.type }}
  {{- end }}
  selector:
    {{- include "kvmesh.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.port }}
      targetPort: grpc
      appProtocol: grpc
    - name: metrics
      port: {{ $v.metricsPort }}
      targetPort: metrics
    {{- if eq $c "gateway" }}
    - name: http
      port: {{ $v.httpPort }}
      targetPort: http
    {{- end }}
{{- end -}}
