{{/* Names ------------------------------------------------------------------------------- */}}
{{- define "pdplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdplane.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>", bounded to a DNS label. Call with (list . "registry"). */}}
{{- define "pdplane.component" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "pdplane.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pdplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdplane
{{- end -}}

{{/* Selector labels of one component. Call with (list . "registry"). */}}
{{- define "pdplane.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pdplane.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "pdplane.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdplane.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdplane.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Addresses ---------------------------------------------------------------------------- */}}
{{- define "pdplane.registryAddress" -}}
{{- printf "%s:%d" (include "pdplane.component" (list . "registry")) (int .Values.registry.port) -}}
{{- end -}}

{{/* The registry address the engines use: their node's heartbeat relay when it is enabled. */}}
{{- define "pdplane.engineRegistryAddress" -}}
{{- if .Values.registryRelay.enabled -}}
{{- printf "%s:%d" (include "pdplane.component" (list . "registry-relay")) (int .Values.registryRelay.port) -}}
{{- else -}}
{{- include "pdplane.registryAddress" . -}}
{{- end -}}
{{- end -}}

{{/*
The gateways' scheduler target. Several replicas: every scheduler pod by the headless -peers
Service (gRPC takes one and moves to the next when it dies; the replicas share their in-flight
assignments, so which one a gateway uses does not change the decisions).
*/}}
{{- define "pdplane.schedulerAddress" -}}
{{- $svc := include "pdplane.component" (list . "scheduler") -}}
{{- if gt (int .Values.scheduler.replicas) 1 -}}
{{- printf "dns:///%s-peers:%d" $svc (int .Values.scheduler.port) -}}
{{- else -}}
{{- printf "%s:%d" $svc (int .Values.scheduler.port) -}}
{{- end -}}
{{- end -}}

{{/* Client endpoints of etcd: the in-chart members by their stable names, or `etcd.endpoints`. */}}
{{- define "pdplane.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- $svc := include "pdplane.component" (list . "etcd") -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "%s-%d.%s.%s.svc.%s:%d" $svc $i $svc $.Release.Namespace $.Values.clusterDomain (int $.Values.etcd.clientPort)) -}}
{{- end -}}
{{- join "," $eps -}}
{{- else -}}
{{- join "," .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{/* Secrets -------------------------------------------------------------------------------- */}}
{{- define "pdplane.authSecretName" -}}
{{- default (include "pdplane.component" (list . "auth")) .Values.auth.existingSecret -}}
{{- end -}}

{{/* PDPLANE_TOKEN from the auth Secret. */}}
{{- define "pdplane.tokenEnv" -}}
- name: PDPLANE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdplane.authSecretName" . }}
      key: {{ .Values.auth.tokenKey }}
{{- end -}}

{{/* The admin token: only where drains come from (registry checks, engines' preStop sends). */}}
{{- define "pdplane.adminTokenEnv" -}}
- name: PDPLANE_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdplane.authSecretName" . }}
      key: {{ .Values.auth.adminTokenKey }}
      optional: true
{{- end -}}

{{/* TLS: the env of a gRPC server and client (server = true adds cert and key). */}}
{{- define "pdplane.tlsEnv" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.tls.enabled -}}
- name: PDPLANE_TLS_CA
  value: {{ printf "%s/ca.crt" $root.Values.tls.mountPath | quote }}
{{- if index . 1 }}
- name: PDPLANE_TLS_CERT
  value: {{ printf "%s/tls.crt" $root.Values.tls.mountPath | quote }}
- name: PDPLANE_TLS_KEY
  value: {{ printf "%s/tls.key" $root.Values.tls.mountPath | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdplane.tlsVolume" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  secret:
    secretName: {{ .Values.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "pdplane.tlsVolumeMount" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
Health probes of a pdplane gRPC server. Kubernetes' native gRPC probe (grpc.health.v1) speaks
plaintext only, so with TLS on the probe runs pdplane-healthcheck inside the container instead.
Call with (list . port serverName).
*/}}
{{- define "pdplane.grpcProbe" -}}
{{- $root := index . 0 -}}
{{- $service := "" -}}
{{- if gt (len .) 3 }}{{ $service = index . 3 }}{{ end -}}
{{- if $root.Values.tls.enabled -}}
exec:
  command:
    - pdplane-healthcheck
    - grpc
    - {{ printf "127.0.0.1:%d" (int (index . 1)) | quote }}
    - --tls-ca
    - {{ printf "%s/ca.crt" $root.Values.tls.mountPath | quote }}
    - --tls-server-name
    - {{ index . 2 | quote }}
    {{- if $service }}
    - --service
    - {{ $service | quote }}
    {{- end }}
{{- else -}}
grpc:
  port: {{ index . 1 }}
  {{- if $service }}
  service: {{ $service | quote }}
  {{- end }}
{{- end -}}
{{- end -}}

{{/* Checks that fail the render with a clear message. */}}
{{- define "pdplane.validate" -}}
{{- if and (eq .Values.registry.store "memory") (gt (int .Values.registry.replicas) 1) -}}
{{- fail "registry.replicas > 1 needs registry.store=etcd (the memory store lives in one process)" -}}
{{- end -}}
{{- if not (has .Values.registry.store (list "memory" "etcd")) -}}
{{- fail (printf "registry.store must be memory or etcd, not %q" .Values.registry.store) -}}
{{- end -}}
{{- if and (eq .Values.registry.store "etcd") (not .Values.etcd.enabled) (empty .Values.etcd.endpoints) -}}
{{- fail "registry.store=etcd needs etcd.enabled=true or etcd.endpoints" -}}
{{- end -}}
{{- if not (has .Values.scheduler.mode (list "remote" "embedded")) -}}
{{- fail (printf "scheduler.mode must be remote or embedded, not %q" .Values.scheduler.mode) -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) -}}
{{- fail "tls.enabled needs tls.existingSecret (a Secret with tls.crt, tls.key and ca.crt)" -}}
{{- end -}}
{{- end -}}
