{{/* <release>-kvmesh, or the release name when it already says kvmesh. */}}
{{- define "kvmesh.fullname" -}}
{{- if contains "kvmesh" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvmesh" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* A component's object (and Service DNS) name: <fullname>-<component>. Argument: (list $ "router"). */}}
{{- define "kvmesh.name" -}}
{{- printf "%s-%s" (include "kvmesh.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{/* host:port of a component's Service, what other services dial. Argument: (list $ "router"). */}}
{{- define "kvmesh.address" -}}
{{- $root := index . 0 -}}{{- $c := index . 1 -}}
{{- printf "%s:%v" (include "kvmesh.name" .) (index $root.Values $c).port -}}
{{- end -}}

{{- define "kvmesh.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: kvmesh
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvmesh.labels" -}}
{{- $root := index . 0 -}}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/part-of: kvmesh
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version }}
{{- end -}}

{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The Redis the routers share: the subchart's Service, or externalRedis.url. */}}
{{- define "kvmesh.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:6379/0" (printf "%s-redis" .Release.Name | trunc 63 | trimSuffix "-") -}}
{{- else -}}
{{- required "redis.enabled=false needs externalRedis.url (redis://host:port/db)" .Values.externalRedis.url -}}
{{- end -}}
{{- end -}}

{{/* The model folder the services load. */}}
{{- define "kvmesh.modelDir" -}}
{{- if eq .Values.model.source "image" -}}
{{- required "model.source=image needs model.path (the folder inside the image)" .Values.model.path -}}
{{- else -}}
{{- printf "%s/%s" .Values.model.cache.mountPath .Values.model.name -}}
{{- end -}}
{{- end -}}

{{- define "kvmesh.modelClaim" -}}
{{- .Values.model.cache.existingClaim | default (include "kvmesh.name" (list . "model-cache")) -}}
{{- end -}}

{{/* The marker the model-init Job writes when the cache is complete. */}}
{{- define "kvmesh.modelReady" -}}
{{- printf "%s/.kvmesh-ready" (include "kvmesh.modelDir" .) -}}
{{- end -}}

{{/* Whether the model pods must wait for the model-init Job. */}}
{{- define "kvmesh.waitsForModel" -}}
{{- if and (eq .Values.model.source "cache") .Values.model.init.enabled -}}true{{- end -}}
{{- end -}}

{{- define "kvmesh.apiKeysSecret" -}}
{{- .Values.gateway.apiKeys.existingSecret | default (include "kvmesh.name" (list . "api-keys")) -}}
{{- end -}}

{{/* Roles with a certificate: the six services and "operator" (kvmesh health, admin calls). */}}
{{- define "kvmesh.tls.roles" -}}
{{- list "gateway" "router" "prefill" "decode" "kvstore" "speculator" "operator" | toJson -}}
{{- end -}}

{{/* The Secret holding a role's certificate. Argument: (list $ "decode"). */}}
{{- define "kvmesh.tls.secret" -}}
{{- printf "%s-tls" (include "kvmesh.name" .) -}}
{{- end -}}

{{/* "true" when cert-manager makes the certificates (tls.source, or auto and its API is installed). */}}
{{- define "kvmesh.tls.certManager" -}}
{{- $source := .Values.tls.source -}}
{{- if eq $source "auto" -}}
{{- .Capabilities.APIVersions.Has "cert-manager.io/v1" -}}
{{- else -}}
{{- eq $source "certManager" -}}
{{- end -}}
{{- end -}}
