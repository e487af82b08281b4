{{/*
A Job that runs one `archway` command to completion, as the certgen Jobs and CronJob
(certgen/) and the gate-release hook (gate-release-hook.yaml) do: up to 5 tries within 5
minutes, scheduled like the certgen Jobs (tls.bootstrap: priorityClassName, nodeSelector,
affinity, tolerations, resources), as the given ServiceAccount. Call with
(dict "root" $ "component" NAME "serviceAccount" SA "args" ARGS "hook" BOOL) where ARGS is the
YAML list of the command's arguments; a hook's pods get the chart's hook PriorityClass
(hook-priorityclass.yaml) unless tls.bootstrap.priorityClassName names one.
*/}}
{{- define "archway.commandJobSpec" -}}
backoffLimit: 4
activeDeadlineSeconds: 300
template:
  metadata:
    labels:
      {{- include "archway.podLabels" (list .root .component dict) | nindent 6 }}
  spec:
    {{- include "archway.commandPodSpec" . | nindent 4 }}
{{- end -}}

{{- define "archway.commandPodSpec" -}}
serviceAccountName: {{ .serviceAccount }}
restartPolicy: OnFailure
{{- with include "archway.imagePullSecrets" .root }}
{{ . }}
{{- end }}
{{- with include "archway.jobPriorityClassName" . }}
priorityClassName: {{ . }}
{{- end }}
{{ include "archway.podPlacement" (list .root .root.Values.tls.bootstrap) }}
{{- with .root.Values.tls.bootstrap.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: {{ .component }}
    image: {{ include "archway.image" .root }}
    imagePullPolicy: {{ .root.Values.image.pullPolicy }}
    args:
      {{- .args | nindent 6 }}
    {{- with .root.Values.tls.bootstrap.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .root.Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end -}}

{{/* The priorityClassName of a command Job's pods (archway.commandPodSpec). */}}
{{- define "archway.jobPriorityClassName" -}}
{{- if .root.Values.tls.bootstrap.priorityClassName -}}
{{ .root.Values.tls.bootstrap.priorityClassName }}
{{- else if and .hook (include "archway.hookPriorityClass.enabled" .root) -}}
{{ include "archway.hookPriorityClassName" .root }}
{{- end -}}
{{- end -}}

{{/* Does the chart make its own PriorityClass for its hook Jobs? "true" or "". */}}
{{- define "archway.hookPriorityClass.enabled" -}}
{{- if and .Values.hooks.priorityClass.create (not .Values.tls.bootstrap.priorityClassName) }}true{{ end -}}
{{- end -}}

{{- define "archway.hookPriorityClassName" -}}
{{ include "archway.suffixedName" (list . "-hooks") }}
{{- end -}}
