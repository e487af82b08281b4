{{/* Names ------------------------------------------------------------------------------- */}}
{{- define "archway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "archway.fullname" -}}
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

{{/* Resource names derived from the full name (kept short: Service names are DNS labels). */}}
{{- define "archway.webhookName" -}}{{ include "archway.fullname" . | trunc 55 | trimSuffix "-" }}{{- end -}}
{{- define "archway.serviceName" -}}{{ include "archway.webhookName" . }}{{- end -}}
{{- define "archway.webhookConfigName" -}}{{ include "archway.fullname" . }}{{- end -}}
{{- define "archway.configMapName" -}}{{ include "archway.fullname" . | trunc 56 | trimSuffix "-" }}-config{{- end -}}
{{- define "archway.tlsSecretName" -}}{{ default (printf "%s-tls" (include "archway.fullname" . | trunc 59 | trimSuffix "-")) .Values.tls.secretName }}{{- end -}}
{{- define "archway.certgenName" -}}{{ include "archway.fullname" . | trunc 52 | trimSuffix "-" }}-certgen{{- end -}}
{{- define "archway.schedulerFullname" -}}{{ include "archway.fullname" . | trunc 53 | trimSuffix "-" }}-scheduler{{- end -}}
{{- define "archway.certificateName" -}}{{ include "archway.fullname" . | trunc 55 | trimSuffix "-" }}-serving{{- end -}}
{{- define "archway.leaseName" -}}{{ default .Values.scheduler.name .Values.scheduler.leaseName }}{{- end -}}

{{/* Labels ------------------------------------------------------------------------------ */}}
{{- define "archway.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "archway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: webhook, scheduler, certgen. Call with (list $ "name"). */}}
{{- define "archway.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "archway.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "archway.componentLabels" -}}
{{ include "archway.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Images ------------------------------------------------------------------------------ */}}
{{/* repository@digest when image.digest is set (pins the exact index pushed, whatever the tag
     now points to), else repository:tag (default: the chart's appVersion). */}}
{{- define "archway.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end -}}
{{- end -}}

{{- define "archway.schedulerImage" -}}
{{- $tag := .Values.scheduler.image.tag -}}
{{- if not $tag -}}
{{- $tag = regexFind "^v[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- end -}}
{{ .Values.scheduler.image.repository }}:{{ $tag }}
{{- end -}}

{{/* Namespaces the webhook never intercepts: the configured ones plus archway's own. */}}
{{- define "archway.excludedNamespaces" -}}
{{- $ns := concat .Values.webhook.excludeNamespaces (list .Release.Namespace) | uniq -}}
{{- toJson $ns -}}
{{- end -}}

{{/* The scheduler name the webhook injects, or "" when it injects none. */}}
{{- define "archway.injectedSchedulerName" -}}
{{- if .Values.scheduler.setSchedulerName }}{{ .Values.scheduler.name }}{{ end -}}
{{- end -}}

{{/* archway configuration files ----------------------------------------------------------- */}}
{{/* Sections shared by the webhook and the extender sidecar (everything but `server`). */}}
{{- define "archway.configBase" -}}
{{- $c := deepCopy .Values.config -}}
{{- $admission := default dict $c.admission -}}
{{- $excluded := include "archway.excludedNamespaces" . | fromJsonArray -}}
{{- $_ := set $admission "exclude_namespaces" (concat (default list $admission.exclude_namespaces) $excluded | uniq) -}}
{{- $_ := set $c "admission" $admission -}}
{{- $registry := default dict $c.registry -}}
{{- if .Values.credentialProviders.enabled -}}
{{- $_ := set $registry "credential_providers" (dict
    "config" (printf "%s/config.yaml" (include "archway.providerConfigDir" .))
    "bin_dir" (include "archway.providerBinDir" .)
    "timeout_seconds" .Values.credentialProviders.timeoutSeconds) -}}
{{- end -}}
{{- if .Values.registryHosts.enabled -}}
{{- $_ := set $registry "hosts_dir" .Values.registryHosts.hostPath -}}
{{- end -}}
{{- $_ := set $c "registry" $registry -}}
{{- $sched := include "archway.injectedSchedulerName" . -}}
{{- if $sched -}}
{{- $_ := set $c "placement" (dict "scheduler_name" $sched) -}}
{{- end -}}
{{- range $k, $v := $c -}}
{{- if not $v }}{{ $_ := unset $c $k }}{{ end -}}
{{- end -}}
{{- toJson $c -}}
{{- end -}}

{{- define "archway.webhookConfig" -}}
{{- $c := include "archway.configBase" . | fromJson -}}
{{- $_ := set $c "server" (dict
    "product" "webhook"
    "bind" (printf "%s:%d" (include "archway.bindHost" .Values.webhook.bindAddress) (int .Values.webhook.port))
    "tls" true
    "cert_file" "/etc/archway/tls/tls.crt"
    "key_file" "/etc/archway/tls/tls.key"
    "state_dir" "/var/lib/archway"
    "workers" (int .Values.webhook.workers)
    "threads" (int .Values.webhook.threads)
    "log_every_admission" .Values.webhook.logEveryAdmission) -}}
{{- toYaml $c -}}
{{- end -}}

{{- define "archway.extenderConfig" -}}
{{- $c := include "archway.configBase" . | fromJson -}}
{{- $host := ternary "0.0.0.0" "127.0.0.1" .Values.scheduler.extender.exposeMetrics -}}
{{- $_ := set $c "server" (dict
    "product" "extender"
    "bind" (printf "%s:%d" $host (int .Values.scheduler.extender.port))
    "tls" false
    "state_dir" "/var/lib/archway"
    "workers" (int .Values.scheduler.extender.workers)
    "threads" (int .Values.webhook.threads)) -}}
{{- toYaml $c -}}
{{- end -}}

{{/* Registry access as the nodes have it ------------------------------------------------ */}}
{{- define "archway.providerConfigDir" -}}/etc/archway/credential-providers/config{{- end -}}
{{- define "archway.providerBinDir" -}}/etc/archway/credential-providers/bin{{- end -}}

{{/* The CredentialProviderConfig the plugins run with: the kubelet's own file format. */}}
{{- define "archway.credentialProviderConfig" -}}
{{- $p := .Values.credentialProviders -}}
{{- if not $p.providers }}
{{- fail "credentialProviders.enabled needs credentialProviders.providers (the CredentialProviderConfig providers, as on the nodes)" }}
{{- end }}
{{- if and (not $p.hostPath) (not $p.initContainers) }}
{{- fail "credentialProviders.enabled needs the plugin executables: credentialProviders.hostPath (a node directory holding them) or credentialProviders.initContainers (copying them into the credential-provider-bin volume)" }}
{{- end -}}
apiVersion: kubelet.config.k8s.io/v1
kind: CredentialProviderConfig
providers:
  {{- toYaml $p.providers | nindent 2 }}
{{- end -}}

{{/* Init containers, mounts and volumes of every pod running archway (webhook, extender). */}}
{{- define "archway.registryAccessInitContainers" -}}
{{- if and .Values.credentialProviders.enabled .Values.credentialProviders.initContainers -}}
{{- toYaml .Values.credentialProviders.initContainers }}
{{- end -}}
{{- end -}}

{{- define "archway.registryAccessMounts" -}}
{{- if .Values.credentialProviders.enabled }}
- name: credential-provider-config
  mountPath: {{ include "archway.providerConfigDir" . }}
  readOnly: true
- name: credential-provider-bin
  mountPath: {{ include "archway.providerBinDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.registryHosts.enabled }}
- name: registry-hosts
  mountPath: {{ .Values.registryHosts.hostPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "archway.registryAccessVolumes" -}}
{{- $p := .Values.credentialProviders -}}
{{- if $p.enabled }}
- name: credential-provider-config
  configMap:
    name: {{ include "archway.configMapName" . }}
    items:
      - key: credential-providers.yaml
        path: config.yaml
- name: credential-provider-bin
  {{- if $p.hostPath }}
  hostPath:
    path: {{ $p.hostPath }}
    type: Directory
  {{- else }}
  emptyDir:
    sizeLimit: 256Mi
  {{- end }}
{{- end }}
{{- if .Values.registryHosts.enabled }}
- name: registry-hosts
  hostPath:
    path: {{ .Values.registryHosts.hostPath }}
    type: Directory
{{- end }}
{{- end -}}

{{/* IPv6 addresses go in brackets in HOST:PORT. */}}
{{- define "archway.bindHost" -}}
{{- if and (contains ":" .) (not (hasPrefix "[" .)) }}[{{ . }}]{{ else }}{{ . }}{{ end -}}
{{- end -}}

{{/* The KubeSchedulerConfiguration: the same document `archway scheduler-config` prints. */}}
{{- define "archway.schedulerConfig" -}}
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: true
  resourceName: {{ include "archway.leaseName" . }}
  resourceNamespace: {{ .Release.Namespace }}
profiles:
  - schedulerName: {{ .Values.scheduler.name }}
extenders:
  - urlPrefix: {{ printf "http://127.0.0.1:%d/scheduler" (int .Values.scheduler.extender.port) }}
    filterVerb: filter
    prioritizeVerb: prioritize
    weight: {{ int .Values.scheduler.extender.weight }}
    enableHTTPS: false
    nodeCacheCapable: {{ .Values.scheduler.extender.nodeCacheCapable }}
    ignorable: true
    httpTimeout: {{ .Values.scheduler.extender.httpTimeout }}
{{- end -}}

{{/* `imagePullSecrets:` for a pod spec, or nothing. Use as {{- include ... | nindent N }} only
     through "archway.podImagePullSecrets" below, which swallows the empty case. */}}
{{- define "archway.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets -}}
imagePullSecrets:
{{ toYaml . }}
{{- end -}}
{{- end -}}

{{/* Seconds in a Go duration limited to "<n>s" or "<n>ms" (values.schema.json enforces that). */}}
{{- define "archway.durationSeconds" -}}
{{- if hasSuffix "ms" . -}}
{{- divf (trimSuffix "ms" . | float64) 1000 -}}
{{- else -}}
{{- trimSuffix "s" . | float64 -}}
{{- end -}}
{{- end -}}
