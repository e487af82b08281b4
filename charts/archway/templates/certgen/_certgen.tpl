{{/*
The bootstrap of the webhook's certificate (tls.mode=bootstrap), run three ways:
- Job "<certgen>-create", pre-install/pre-upgrade: creates or renews the Secret before the webhook
  pods start (they mount it), and on upgrade patches the caBundle first when the CA changes;
- Job "<certgen>-patch", post-install/post-upgrade: patches the caBundle into the webhook
  configuration, which exists only after the install;
- CronJob "<certgen>-renew": renews before expiry without a `helm upgrade`.
The hook Jobs get their own hook-scoped ServiceAccount and RBAC (created before, deleted after),
because on a first install nothing else exists yet when the pre-install Job runs.
*/}}

{{- define "archway.certgen.args" -}}
- certs
- bootstrap
- --service={{ include "archway.serviceName" .root }}
- --namespace={{ .root.Release.Namespace }}
- --secret={{ include "archway.tlsSecretName" .root }}
- --webhook-config={{ include "archway.webhookConfigName" .root }}
- --days={{ int .root.Values.tls.bootstrap.days }}
- --ca-days={{ int .root.Values.tls.bootstrap.caDays }}
- --renew-before-days={{ int .root.Values.tls.bootstrap.renewBeforeDays }}
- --cluster-domain={{ .root.Values.clusterDomain }}
{{- with .root.Values.webhook.url }}
- --host={{ (urlParse .).hostname }}
{{- end }}
{{- if .allowMissing }}
- --allow-missing-webhook-config
{{- end }}
{{- end -}}

{{/* The Job spec of every certgen run (archway.commandJobSpec). Call with
(dict "root" $ "serviceAccount" NAME "allowMissing" BOOL "hook" BOOL). */}}
{{- define "archway.certgen.jobSpec" -}}
{{- include "archway.commandJobSpec" (dict "root" .root "component" "certgen"
      "serviceAccount" .serviceAccount "hook" .hook "args" (include "archway.certgen.args" .)) }}
{{- end -}}

{{/* Least-privilege RBAC of a certgen ServiceAccount. Call with (dict "root" $ "name" NAME "hook" BOOL). */}}
{{- define "archway.certgen.rbac" -}}
{{- $root := .root -}}
{{- $meta := include "archway.certgen.meta" . -}}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ .name }}
  namespace: {{ $root.Release.Namespace }}
  {{- $meta | nindent 2 }}
{{- if $root.Values.rbac.create }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {{ .name }}
  namespace: {{ $root.Release.Namespace }}
  {{- $meta | nindent 2 }}
rules:
  # RBAC cannot restrict `create` by name; get/update are limited to the two Secrets.
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["create"]
  - apiGroups: [""]
    resources: ["secrets"]
    resourceNames:
      - {{ include "archway.tlsSecretName" $root }}
      - {{ include "archway.tlsSecretName" $root }}-ca
    verbs: ["get", "update"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{ .name }}
  namespace: {{ $root.Release.Namespace }}
  {{- $meta | nindent 2 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: {{ .name }}
subjects:
  - kind: ServiceAccount
    name: {{ .name }}
    namespace: {{ $root.Release.Namespace }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: {{ .name }}
  {{- $meta | nindent 2 }}
rules:
  # Its own webhook configuration only.
  - apiGroups: ["admissionregistration.k8s.io"]
    resources: ["mutatingwebhookconfigurations"]
    resourceNames: [{{ include "archway.webhookConfigName" $root | quote }}]
    verbs: ["get", "patch"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {{ .name }}
  {{- $meta | nindent 2 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ .name }}
subjects:
  - kind: ServiceAccount
    name: {{ .name }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}
{{- end -}}

{{- define "archway.certgen.meta" -}}
labels:
  {{- include "archway.componentLabels" (list .root "certgen") | nindent 2 }}
{{- if .hook }}
annotations:
  helm.sh/hook: pre-install,pre-upgrade,post-install,post-upgrade
  helm.sh/hook-weight: "-10"
  helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end }}
{{- end -}}
