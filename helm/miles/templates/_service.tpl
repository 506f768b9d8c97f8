{{/*
The Deployment, Service, HPA, PDB and ServiceAccount of one shared service. Called from the component's own
files (one kind per file) with (dict "root" $ "component" "<name>" "key" "<valuesKey>").
A component's values: enabled, replicaCount, image, ports (http | grpc + metrics), resources, nodePool,
settings (-> MILES_<envPrefix>_*), usesRedis, extraEnv, autoscaling, podDisruptionBudget, podAnnotations.
*/}}

{{- define "miles.metricsPort" -}}
{{- $c := index .root.Values .key -}}
{{- if hasKey $c.ports "metrics" }}{{ $c.ports.metrics }}{{ else }}{{ $c.ports.http }}{{ end -}}
{{- end -}}

{{/*
Where another shared service is reached, for settings field .field: target "<componentKey>" is its HTTP port,
"<componentKey>:<port name>" another named port. Fields named *_url get a URL (http://<fullname>-<component>:<port>),
others host:port. A disabled component gives "" (the settings' "none").
*/}}
{{- define "miles.linkValue" -}}
{{- $parts := splitList ":" .target -}}
{{- $key := first $parts -}}
{{- $target := index .root.Values $key | required (printf "links: unknown component %q" $key) -}}
{{- $portName := ternary (last $parts) "http" (gt (len $parts) 1) -}}
{{- $port := index $target.ports $portName | required (printf "links: component %q has no port %q" $key $portName) -}}
{{- $host := printf "%s-%s" (include "miles.fullname" .root) ($key | kebabcase) -}}
{{- if not $target.enabled -}}
{{- else if hasSuffix "_url" .field -}}
{{- printf "http://%s:%v" $host $port -}}
{{- else -}}
{{- printf "%s:%v" $host $port -}}
{{- end -}}
{{- end -}}

{{- define "miles.serviceDeployment" -}}
{{- $root := .root -}}
{{- $c := index $root.Values .key -}}
{{- $ctx := dict "root" $root "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "miles.componentName" $ctx }}
  labels:
    {{- include "miles.labels" $ctx | nindent 4 }}
spec:
  {{- if not $c.autoscaling.enabled }}
  replicas: {{ $c.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "miles.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "miles.labels" $ctx | nindent 8 }}
      {{- with $c.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "miles.componentName" $ctx }}
      automountServiceAccountToken: {{ $c.rbac | default false }}
      # Service links would inject MILES_<NAME>_PORT=tcp://... variables that collide with settings names.
      enableServiceLinks: false
      securityContext:
        {{- include "miles.podSecurityContext" $root | nindent 8 }}
      {{- with $root.Values.global.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- include "miles.nodePlacement" (dict "root" $root "pool" $c.nodePool) | nindent 6 }}
      topologySpreadConstraints:
        - maxSkew: 1
          topologyKey: kubernetes.io/hostname
          whenUnsatisfiable: ScheduleAnyway
          labelSelector:
            matchLabels:
              {{- include "miles.selectorLabels" $ctx | nindent 14 }}
      terminationGracePeriodSeconds: {{ $c.terminationGracePeriodSeconds | default 30 }}
      containers:
        - name: {{ .component }}
          image: {{ include "miles.image" (dict "root" $root "image" $c.image) }}
          imagePullPolicy: {{ $root.Values.global.imagePullPolicy }}
          securityContext:
            {{- include "miles.containerSecurityContext" $root | nindent 12 }}
          ports:
            {{- range $name, $port := $c.ports }}
            - name: {{ $name }}
              containerPort: {{ $port }}
              protocol: TCP
            {{- end }}
          env:
            - name: MILES_{{ $c.envPrefix }}_HOST
              value: "0.0.0.0"
            - name: MILES_{{ $c.envPrefix }}_PORT
              value: {{ default $c.ports.http $c.ports.grpc | quote }}
            {{- if hasKey $c.ports "metrics" }}
            - name: MILES_{{ $c.envPrefix }}_METRICS_PORT
              value: {{ $c.ports.metrics | quote }}
            {{- end }}
            {{- range $field, $target := $c.links }}
            - name: MILES_{{ $c.envPrefix }}_{{ $field | upper }}
              value: {{ include "miles.linkValue" (dict "root" $root "target" $target "field" $field) | quote }}
            {{- end }}
            {{- range $field, $suffix := $c.fullnameSettings }}
            - name: MILES_{{ $c.envPrefix }}_{{ $field | upper }}
              value: {{ printf "%s-%s" (include "miles.fullname" $root) $suffix | quote }}
            {{- end }}
            {{- range $portName, $field := $c.portSettings }}
            - name: MILES_{{ $c.envPrefix }}_{{ $field | upper }}
              value: {{ index $c.ports $portName | quote }}
            {{- end }}
            {{- if $c.usesRedis }}
            - name: MILES_{{ $c.envPrefix }}_REDIS_URL
              valueFrom:
                secretKeyRef:
                  name: {{ include "miles.secretName" $root }}
                  key: redis-url
            {{- end }}
            {{- range $c.secretEnv }}
            - name: MILES_{{ $c.envPrefix }}_{{ .field | upper }}
              valueFrom:
                secretKeyRef:
                  name: {{ include "miles.secretName" $root }}
                  key: {{ .secretKey }}
            {{- end }}
            {{- include "miles.settingsEnv" (dict "prefix" $c.envPrefix "settings" $c.settings) | nindent 12 }}
            {{- if and (eq .key "controller") (hasKey $c.settings "shared_pools") }}
            {{- fail "controller.settings.shared_pools is set by the chart from sharedPools: declare the pools there" }}
            {{- end }}
            {{- if and (eq .key "controller") (hasKey $c.settings "kubernetes_kueue") }}
            {{- fail "controller.settings.kubernetes_kueue is set by the chart from kueue.enabled: set that instead" }}
            {{- end }}
            {{- if and (eq .key "controller") $root.Values.sharedPools }}
            # The shared engine pools of this release (sharedPools), which LoRA jobs may run on.
            - name: MILES_CONTROLLER_SHARED_POOLS
              value: {{ include "miles.sharedPools.controllerJson" $root | quote }}
            {{- end }}
            {{- if and (eq .key "controller") $root.Values.kueue.enabled }}
            # Jobs with a kueue block are admitted by Kueue (kueue.enabled).
            - name: MILES_CONTROLLER_KUBERNETES_KUEUE
              value: "true"
            {{- end }}
            {{- if $root.Values.tracing.otlpEndpoint }}
            - name: OTEL_EXPORTER_OTLP_ENDPOINT
              value: {{ $root.Values.tracing.otlpEndpoint | quote }}
            {{- end }}
            {{- with $c.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          livenessProbe:
            httpGet:
              path: /healthz
              port: {{ include "miles.metricsPort" . }}
            periodSeconds: 10
            timeoutSeconds: 3
            failureThreshold: 6
          readinessProbe:
            httpGet:
              path: /readyz
              port: {{ include "miles.metricsPort" . }}
            periodSeconds: 5
            timeoutSeconds: 3
            failureThreshold: 3
          resources:
            {{- toYaml $c.resources | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- with $c.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $c.tmpSizeLimit | default "1Gi" }}
        {{- with $c.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}

{{- define "miles.serviceService" -}}
{{- $c := index .root.Values .key -}}
{{- $ctx := dict "root" .root "component" .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "miles.componentName" $ctx }}
  labels:
    {{- include "miles.labels" $ctx | nindent 4 }}
spec:
  type: {{ $c.serviceType | default "ClusterIP" }}
  selector:
    {{- include "miles.selectorLabels" $ctx | nindent 4 }}
  ports:
    {{- range $name, $port := $c.ports }}
    - name: {{ $name }}
      port: {{ $port }}
      targetPort: {{ $name }}
      protocol: TCP
      {{- if eq $name "grpc" }}
      appProtocol: grpc
      {{- end }}
    {{- end }}
{{- end -}}

{{- define "miles.serviceHpa" -}}
{{- $c := index .root.Values .key -}}
{{- $ctx := dict "root" .root "component" .component -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "miles.componentName" $ctx }}
  labels:
    {{- include "miles.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "miles.componentName" $ctx }}
  minReplicas: {{ $c.autoscaling.minReplicas }}
  maxReplicas: {{ $c.autoscaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $c.autoscaling.targetCPUUtilizationPercentage }}
{{- end -}}

{{- define "miles.servicePdb" -}}
{{- $c := index .root.Values .key -}}
{{- $ctx := dict "root" .root "component" .component -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "miles.componentName" $ctx }}
  labels:
    {{- include "miles.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ $c.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "miles.selectorLabels" $ctx | nindent 6 }}
{{- end -}}

{{- define "miles.serviceAccount" -}}
{{- $ctx := dict "root" .root "component" .component -}}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ include "miles.componentName" $ctx }}
  labels:
    {{- include "miles.labels" $ctx | nindent 4 }}
automountServiceAccountToken: false
{{- end -}}
