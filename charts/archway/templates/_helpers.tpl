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
{{- /* The webhook's name in its configuration: the apiserver's metrics label its calls with it. */ -}}
{{- define "archway.podWebhookName" -}}pods.archway.dev{{- end -}}
{{- define "archway.debugWebhookName" -}}debug-containers.archway.dev{{- end -}}
{{- define "archway.webhookConfigName" -}}{{ include "archway.fullname" . }}{{- end -}}
{{- define "archway.configMapName" -}}{{ include "archway.fullname" . | trunc 56 | trimSuffix "-" }}-config{{- end -}}
{{- define "archway.tlsSecretName" -}}{{ default (printf "%s-tls" (include "archway.fullname" . | trunc 59 | trimSuffix "-")) .Values.tls.secretName }}{{- end -}}
{{- define "archway.certgenName" -}}{{ include "archway.fullname" . | trunc 52 | trimSuffix "-" }}-certgen{{- end -}}
{{- define "archway.schedulerFullname" -}}{{ include "archway.fullname" . | trunc 53 | trimSuffix "-" }}-scheduler{{- end -}}
{{- define "archway.certificateName" -}}{{ include "archway.fullname" . | trunc 55 | trimSuffix "-" }}-serving{{- end -}}
{{/* "<full name><suffix>" within `limit` characters (default 63, a DNS label; 52 for a CronJob,
     whose Jobs add 11): the full name is cut, never the suffix that says what the object is.
     Call with (list $ "-certgen-renew" 52). */}}
{{- define "archway.suffixedName" -}}
{{- $suffix := index . 1 -}}
{{- $limit := 63 -}}
{{- if gt (len .) 2 }}{{ $limit = index . 2 }}{{ end -}}
{{- include "archway.fullname" (index . 0) | trunc (sub $limit (len $suffix) | int) | trimSuffix "-" -}}{{ $suffix }}
{{- end -}}
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

{{/* Labels of a pod template: what archway relies on (the component's selector labels, and
     the skip label: archway never admits its own pods), then the component's podLabels, then
     commonLabels; an earlier one is never overridden by a later one. Call with
     (list $ "component" podLabels). */}}
{{- define "archway.podLabels" -}}
{{- $root := index . 0 -}}
{{- $own := include "archway.selectorLabels" (list $root (index . 1)) | fromYaml -}}
{{- $_ := set $own $root.Values.webhook.skipLabel "true" -}}
{{- toYaml (merge $own (default dict (index . 2)) (default dict $root.Values.commonLabels)) -}}
{{- end -}}

{{- define "archway.componentLabels" -}}
{{ include "archway.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Images ------------------------------------------------------------------------------ */}}
{{/* repository@digest when image.digest is set (pins the exact index pushed, whatever the tag
     now points to), else repository:tag. The default tag is the release's: "v" + appVersion,
     as scripts/release.sh tags the commit and the image (v0.1.0). */}}
{{- define "archway.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ default (printf "v%s" .Chart.AppVersion) .Values.image.tag }}
{{- end -}}
{{- end -}}

{{/* kube-scheduler follows the version skew policy: never newer than the apiserver. By default
     it is the cluster's own version (a "-eks-..." or "+k3s1" suffix dropped: those are not
     registry.k8s.io tags). */}}
{{- define "archway.schedulerImage" -}}
{{- $cluster := regexFind "^v[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- $tag := .Values.scheduler.image.tag -}}
{{- if not $tag -}}
{{- $tag = $cluster -}}
{{- else if gt (semver $tag).Minor (semver $cluster).Minor -}}
{{- fail (printf "scheduler.image.tag %s is newer than the cluster (%s): a kube-scheduler must not be newer than the apiserver; leave the tag empty to follow the cluster" $tag $cluster) -}}
{{- end -}}
{{ .Values.scheduler.image.repository }}:{{ $tag }}
{{- end -}}

{{/* "true" when the second scheduler is installed: when it is used (setSchedulerName) or asked for. */}}
{{- define "archway.schedulerInstalled" -}}
{{- if or .Values.scheduler.enabled .Values.scheduler.setSchedulerName }}true{{ end -}}
{{- end -}}

{{/* nodeSelector and affinity of a pod running the archway image: kubernetes.io/os linux, and
     kubernetes.io/arch In image.architectures ADDED TO EVERY required node affinity term (terms
     are ORed: a term of its own would widen, not narrow). Call with (list $ componentValues). */}}
{{- define "archway.podPlacement" -}}
{{- $root := index . 0 -}}
{{- $v := index . 1 -}}
{{- $archs := $root.Values.image.architectures -}}
{{- if not $archs -}}
{{- fail "image.architectures must list the CPU architectures the archway image has (e.g. [amd64, arm64])" -}}
{{- end -}}
{{- $selector := merge (deepCopy (default dict $v.nodeSelector)) (dict "kubernetes.io/os" "linux") -}}
{{- $affinity := deepCopy (default dict $v.affinity) -}}
{{- $nodeAffinity := default dict $affinity.nodeAffinity -}}
{{- $required := default dict (get $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution") -}}
{{- $terms := default (list dict) $required.nodeSelectorTerms -}}
{{- $arch := dict "key" "kubernetes.io/arch" "operator" "In" "values" $archs -}}
{{- $pinned := list -}}
{{- range $terms -}}
{{- $pinned = append $pinned (merge (dict "matchExpressions" (append (default list .matchExpressions) $arch)) .) -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $pinned -}}
{{- $_ := set $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ := set $affinity "nodeAffinity" $nodeAffinity -}}
nodeSelector:
  {{- toYaml $selector | nindent 2 }}
affinity:
  {{- toYaml $affinity | nindent 2 }}
{{- end -}}

{{/* Values that only make sense together, checked once (included by the webhook Deployment). */}}
{{- define "archway.checkValues" -}}
{{- if eq .Values.tls.mode "secret" -}}
{{- $missing := list -}}
{{- if not .Values.tls.secretName }}{{ $missing = append $missing "tls.secretName (the kubernetes.io/tls Secret you created)" }}{{ end -}}
{{- if not (.Values.tls.secret).caBundle }}{{ $missing = append $missing "tls.secret.caBundle (base64 of the PEM CA that signed it)" }}{{ end -}}
{{- if $missing }}{{ fail (printf "tls.mode=secret needs %s" (join " and " $missing)) }}{{ end -}}
{{- end -}}
{{- $w := .Values.webhook -}}
{{- $pdb := $w.podDisruptionBudget -}}
{{- $min := $pdb.minAvailable -}}
{{- if and $pdb.enabled (not (kindIs "invalid" $min)) (or (eq (toString $min) "100%") (and (not (kindIs "string" $min)) (ge (int $min) (int $w.replicas)))) -}}
{{- fail (printf "webhook.podDisruptionBudget.minAvailable (%v) must be below webhook.replicas (%v), or no webhook pod could ever be evicted and every node drain would block" $pdb.minAvailable $w.replicas) -}}
{{- end -}}
{{- if le (int $w.terminationGracePeriodSeconds) (add (int $w.preStopSleepSeconds) 10 | int) -}}
{{- fail (printf "webhook.terminationGracePeriodSeconds (%v) must exceed webhook.preStopSleepSeconds (%v) + 10 s of graceful shutdown, or in-flight admissions are cut off" $w.terminationGracePeriodSeconds $w.preStopSleepSeconds) -}}
{{- end -}}
{{- if $w.skipArchPinnedPods -}}
{{- if .Values.scheduler.setSchedulerName -}}
{{- fail "webhook.skipArchPinnedPods cannot be used with scheduler.setSchedulerName: pods that pin their arch would never get the schedulerName" -}}
{{- end -}}
{{- if ((default dict .Values.config).admission).deny_on_conflict -}}
{{- fail "webhook.skipArchPinnedPods cannot be used with config.admission.deny_on_conflict: the pods whose arch pin conflicts with their images are exactly the ones it skips" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Namespaces the webhook never intercepts: the configured ones plus archway's own. */}}
{{- define "archway.excludedNamespaces" -}}
{{- $ns := concat (default list .Values.webhook.excludeNamespaces) (list .Release.Namespace) | uniq -}}
{{- toJson $ns -}}
{{- end -}}

{{/* The scheduler name the webhook injects, or "" when it injects none. */}}
{{- define "archway.injectedSchedulerName" -}}
{{- if .Values.scheduler.setSchedulerName }}{{ .Values.scheduler.name }}{{ end -}}
{{- end -}}

{{/* archway configuration files ----------------------------------------------------------- */}}
{{/* Sections shared by the webhook and the extender sidecar (everything but `server`). */}}
{{- define "archway.configBase" -}}
{{- $c := deepCopy (default dict .Values.config) -}}
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
{{- /* Pull secrets are read only where RBAC lets archway read them. */ -}}
{{- $_ := set $c "kubernetes" (merge (dict "pull_secret_namespaces" (default list .Values.rbac.pullSecretNamespaces)) (default dict $c.kubernetes)) -}}
{{- /* ServiceAccount tokens are requested only where RBAC lets archway request them. */ -}}
{{- $_ := set $c "kubernetes" (merge (dict "service_account_token_namespaces" (default list .Values.rbac.serviceAccountTokenNamespaces)) $c.kubernetes) -}}
{{- if include "archway.schedulerInstalled" . -}}
{{- $_ := set $c "placement" (merge (dict "archway_scheduler" .Values.scheduler.name) (default dict $c.placement)) -}}
{{- end -}}
{{- $sched := include "archway.injectedSchedulerName" . -}}
{{- if $sched -}}
{{- $_ := set $c "placement" (merge (dict "scheduler_name" $sched) (default dict $c.placement)) -}}
{{- end -}}
{{- range $k, $v := $c -}}
{{- if not $v }}{{ $_ := unset $c $k }}{{ end -}}
{{- end -}}
{{- toJson $c -}}
{{- end -}}

{{/* The webhook's metrics-only port (server.metrics_bind), never the webhook port. */}}
{{- define "archway.webhookMetricsPort" -}}
{{- if eq (int .Values.webhook.metricsPort) (int .Values.webhook.port) -}}
{{- fail "webhook.metricsPort must differ from webhook.port: /metrics is served apart from the webhook" -}}
{{- end -}}
{{- int .Values.webhook.metricsPort -}}
{{- end -}}

{{- define "archway.webhookConfig" -}}
{{- $c := include "archway.configBase" . | fromJson -}}
{{- $_ := set $c "server" (dict
    "product" "webhook"
    "bind" (printf "%s:%d" (include "archway.bindHost" .Values.webhook.bindAddress) (int .Values.webhook.port))
    "metrics_bind" (printf "%s:%d" (include "archway.bindHost" .Values.webhook.bindAddress) (int (include "archway.webhookMetricsPort" .)))
    "tls" true
    "cert_file" "/etc/archway/tls/tls.crt"
    "key_file" "/etc/archway/tls/tls.key"
    "state_dir" "/var/lib/archway"
    "workers" (int .Values.webhook.workers)
    "threads" (int .Values.webhook.threads)
    "log_every_admission" .Values.webhook.logEveryAdmission
    "log_format" .Values.logFormat) -}}
{{- /* The trust path (certs/trustpath.py): checked against archway's own webhook configuration;
       repaired by the leader with the certificate Job's own arguments in bootstrap mode only
       (cert-manager and a Secret of yours are only checked). */ -}}
{{- $kube := default dict $c.kubernetes -}}
{{- $_ := set $kube "webhook_configuration" (include "archway.webhookConfigName" .) -}}
{{- if eq .Values.tls.mode "bootstrap" -}}
{{- $_ := set $kube "trust_repair" (include "archway.certgen.args" (dict "root" . "allowMissing" false) | fromYamlArray) -}}
{{- end -}}
{{- $_ := set $c "kubernetes" $kube -}}
{{- with .Values.registryEvents }}{{ if .enabled -}}
{{- /* registry push events on their own port, the token from its Secret (registryevents) */ -}}
{{- $registry := default dict $c.registry -}}
{{- $events := default dict $registry.events -}}
{{- $_ := set $events "listen" (printf "%s:%d" (include "archway.bindHost" $.Values.webhook.bindAddress) (int .port)) -}}
{{- $_ := set $events "token_file" "/etc/archway/registry-events/token" -}}
{{- $_ := set $events "tls" .tls -}}
{{- $_ := set $registry "events" $events -}}
{{- $_ := set $c "registry" $registry -}}
{{- end }}{{ end -}}
{{- toYaml $c -}}
{{- end -}}

{{- define "archway.extenderConfig" -}}
{{- $c := include "archway.configBase" . | fromJson -}}
{{- $server := dict
    "product" "extender"
    "bind" (printf "127.0.0.1:%d" (int .Values.scheduler.extender.port))
    "tls" false
    "state_dir" "/var/lib/archway"
    "workers" (int .Values.scheduler.extender.workers)
    "threads" (int .Values.webhook.threads)
    "log_format" .Values.logFormat -}}
{{- if .Values.scheduler.extender.exposeMetrics }}
{{- /* only /metrics, /healthz and /readyz on the pod network; the routes stay on localhost */ -}}
{{- $_ := set $server "metrics_bind" (printf "0.0.0.0:%d" (int .Values.scheduler.extender.metricsPort)) -}}
{{- end }}
{{- $_ := set $c "server" $server -}}
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
    {{- /* Scores need a signal: without Prometheus they are neutral, a call per pod for nothing. */}}
    {{- if ((.Values.config).prometheus).url }}
    prioritizeVerb: prioritize
    weight: {{ int .Values.scheduler.extender.weight }}
    {{- end }}
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
