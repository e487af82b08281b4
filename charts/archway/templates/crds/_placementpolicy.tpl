{{- /* The spec both PlacementPolicy kinds share; `namespaced` false adds the namespaceSelector.
       Architectures are any lower-case name here: archway itself judges whether it knows one
       (an unknown one makes the policy Invalid in its status, never an admission fail). */}}
{{- define "archway.crd.architectures" -}}
type: array
maxItems: 16
x-kubernetes-list-type: set
items:
  type: string
  maxLength: 16
  pattern: '^[a-z0-9_]+$'
{{- end -}}
{{- define "archway.crd.labelValue" -}}
type: string
maxLength: 63
pattern: '^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$'
{{- end -}}
{{- define "archway.crd.selector" -}}
{{- /* Bounded (docs/policies.md, "Limits"): a namespace editor's largest policy costs every
       replica a few KB. archway's reading checks the same, and what a label key may be. */ -}}
type: object
description: {{ . }} (a metav1.LabelSelector; absent selects all).
properties:
  matchLabels:
    type: object
    maxProperties: 16
    additionalProperties:
      {{- include "archway.crd.labelValue" . | nindent 6 }}
  matchExpressions:
    type: array
    maxItems: 16
    items:
      type: object
      required: [key, operator]
      properties:
        key:
          type: string
          maxLength: 317
          pattern: '^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$'
        operator:
          type: string
          enum: [In, NotIn, Exists, DoesNotExist]
        values:
          type: array
          maxItems: 16
          items:
            {{- include "archway.crd.labelValue" . | nindent 12 }}
      x-kubernetes-validations:
        - rule: "self.operator in ['In', 'NotIn'] ? (has(self.values) && size(self.values) > 0) : (!has(self.values) || size(self.values) == 0)"
          message: "In and NotIn need values; Exists and DoesNotExist take none"
x-kubernetes-map-type: atomic
{{- end -}}
{{- define "archway.crd.placementPolicy" -}}
{{- $ := index . 0 }}{{- $kind := index . 1 }}{{- $plural := index . 2 }}{{- $namespaced := index . 3 }}
{{- if dig "install" true (default dict $.Values.crds) }}
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: {{ $plural }}.archway.dev
  annotations:
    # kept on `helm uninstall`: deleting a CRD deletes every policy of it
    helm.sh/resource-policy: keep
  labels:
    {{- include "archway.componentLabels" (list $ "webhook") | nindent 4 }}
spec:
  group: archway.dev
  scope: {{ $namespaced | ternary "Namespaced" "Cluster" }}
  names:
    kind: {{ $kind }}
    listKind: {{ $kind }}List
    plural: {{ $plural }}
    singular: {{ lower $kind }}
    shortNames: [{{ $namespaced | ternary "pp" "cpp" }}]
    categories: [archway]
  versions:
    - name: v1alpha1
      served: true
      storage: true
      subresources:
        status: {}
      additionalPrinterColumns:
        - name: Mode
          type: string
          jsonPath: .spec.mode
        - name: Priority
          type: integer
          jsonPath: .spec.priority
        - name: Selector
          type: string
          jsonPath: .spec.podSelector
        {{- if not $namespaced }}
        - name: Namespaces
          type: string
          jsonPath: .spec.namespaceSelector
        {{- end }}
        - name: Ready
          type: string
          jsonPath: .status.conditions[?(@.type=="Ready")].status
        - name: Age
          type: date
          jsonPath: .metadata.creationTimestamp
      schema:
        openAPIV3Schema:
          type: object
          description: >-
            {{ $kind }}: how archway places the pods it selects{{ if not $namespaced }} in the
            namespaces it selects{{ end }} (docs/policies.md). Precedence: the pod's own
            constraints, PlacementPolicies, ClusterPlacementPolicies, the Namespace's label and
            annotation, the config; within a kind the highest priority wins.
          required: [spec]
          properties:
            spec:
              type: object
              properties:
                priority:
                  type: integer
                  format: int32
                  default: 0
                  minimum: -1000
                  maximum: 1000
                  description: Of two policies that select a pod, the higher wins; equal ones that say different things conflict and neither applies.
                podSelector:
                  {{- include "archway.crd.selector" "The pods it applies to" | nindent 18 }}
                {{- if not $namespaced }}
                namespaceSelector:
                  {{- include "archway.crd.selector" "The namespaces it applies to" | nindent 18 }}
                {{- end }}
                mode:
                  type: string
                  enum: [enforce, audit, "off"]
                  description: "enforce: place pods; audit: annotate only; off: leave them alone."
                preferredArchitectures:
                  type: array
                  maxItems: 16
                  description: Preferred node affinity, per architecture the pod can run on.
                  x-kubernetes-list-type: map
                  x-kubernetes-list-map-keys: [architecture]
                  items:
                    type: object
                    required: [architecture, weight]
                    properties:
                      architecture:
                        type: string
                        maxLength: 16
                      weight:
                        type: integer
                        x-kubernetes-validations:
                          - rule: "self >= 1 && self <= 100"
                            message: "a weight is 1..100"
                allowedArchitectures:
                  description: The pods run only on these (within what their images support).
                  {{- include "archway.crd.architectures" . | nindent 18 }}
                excludedArchitectures:
                  description: The pods never run on these.
                  {{- include "archway.crd.architectures" . | nindent 18 }}
                fallbackArchitectures:
                  description: What an image archway could not read is taken to run on (an admitted pod, and a gated pod released after admission.gate_max_seconds).
                  {{- include "archway.crd.architectures" . | nindent 18 }}
                tolerations:
                  type: array
                  maxItems: 16
                  description: Tolerations added to a pod that may run on the architecture.
                  items:
                    type: object
                    required: [architecture, tolerations]
                    properties:
                      architecture:
                        type: string
                        maxLength: 16
                      tolerations:
                        type: array
                        maxItems: 8
                        items:
                          type: object
                          properties:
                            key: {type: string}
                            operator: {type: string, enum: [Equal, Exists]}
                            value: {type: string}
                            effect: {type: string, enum: ["", NoSchedule, PreferNoSchedule, NoExecute]}
                            tolerationSeconds: {type: integer, format: int64}
                archwayScheduler:
                  type: boolean
                  description: "true: the pods go to archway's scheduler; false: they keep the default one."
                unresolved:
                  type: string
                  enum: [admit, gate, deny]
                  description: What to do with a pod whose image archway cannot read in time.
              x-kubernetes-validations:
                - rule: "!has(self.allowedArchitectures) || !has(self.excludedArchitectures) || self.allowedArchitectures.all(a, !(a in self.excludedArchitectures))"
                  message: "an architecture cannot be both allowed and excluded"
                - rule: "!has(self.allowedArchitectures) || size(self.allowedArchitectures) > 0"
                  message: "allowedArchitectures cannot be empty (no pod could run): leave it out to allow any"
            status:
              type: object
              properties:
                observedGeneration:
                  type: integer
                  format: int64
                conditions:
                  type: array
                  maxItems: 8
                  x-kubernetes-list-type: map
                  x-kubernetes-list-map-keys: [type]
                  items:
                    type: object
                    required: [type, status, lastTransitionTime, reason, message]
                    properties:
                      type: {type: string, maxLength: 316}
                      status: {type: string, enum: ["True", "False", Unknown]}
                      observedGeneration: {type: integer, format: int64, minimum: 0}
                      lastTransitionTime: {type: string, format: date-time}
                      reason: {type: string, maxLength: 1024}
                      message: {type: string, maxLength: 32768}
{{- end }}
{{- end -}}
