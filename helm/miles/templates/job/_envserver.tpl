{{/*
The environment server of one job that runs a hub environment (rollout.environment: verifiers, OpenEnv, Harbor,
reasoning-gym): `python -m miles.envserver` in the connector's own image (its own interpreter, whose pins
conflict with the services'), a Service <fullname>-${JOB_ID}-env-server that the job's rollout workers call
(MILES_ROLLOUT_ENVIRONMENT_URL, set by the controller) and an ingress policy that admits only them. The controller
instantiates these templates (keys env-server-*) only for jobs with an environment, and picks the image of the
job's connector from the Deployment's miles.dev/env-server-images annotation (jobTemplates.envServer.images).
*/}}
{{- define "miles.job.envServerDeployment" -}}
{{- $ctx := dict "root" . "component" "env-server" -}}
{{- $e := .Values.jobTemplates.envServer -}}
{{- $images := dict -}}
{{- range $connector, $image := $e.images }}{{ $_ := set $images $connector (include "miles.image" (dict "root" $ "image" $image)) }}{{ end -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
  annotations:
    # connector -> image; the controller fills ${ENV_SERVER_IMAGE} with the job's and drops this annotation.
    miles.dev/env-server-images: {{ toJson $images | quote }}
spec:
  replicas: ${ENV_SERVER_REPLICAS}
  revisionHistoryLimit: 3
  # The environment's setup time (startup_timeout_s) plus the default 600 s: a slow setup is not a stuck rollout.
  progressDeadlineSeconds: ${ENV_SERVER_PROGRESS_DEADLINE_S}
  selector:
    matchLabels:
      {{- include "miles.job.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "miles.job.labels" $ctx | nindent 8 }}
    spec:
      {{- include "miles.job.podCommon" . | nindent 6 }}
      {{- include "miles.nodePlacement" (dict "root" . "pool" $e.nodePool) | nindent 6 }}
      containers:
        - name: env-server
          image: "${ENV_SERVER_IMAGE}"
          imagePullPolicy: {{ .Values.global.imagePullPolicy }}
          # `python` is the environment's own interpreter: its venv comes first on the image's PATH.
          command: ["python", "-m", "miles.envserver"]
          args:
            - --connector
            - "${ENV_CONNECTOR}"
            - --args
            # The connector's arguments as one line of JSON, escaped by the controller for a double-quoted string.
            - "${ENV_ARGS_JSON}"
            - --host
            - "0.0.0.0"
            - --port
            - {{ $e.port | quote }}
          env:
            # The root filesystem is read-only: caches (e.g. Hugging Face datasets under ~/.cache) go to /tmp.
            - {name: HOME, value: /tmp}
            - {name: PYTHONDONTWRITEBYTECODE, value: "1"}
            - {name: PYTHONUNBUFFERED, value: "1"}
            {{- with $e.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - {name: http, containerPort: {{ $e.port }}, protocol: TCP}
          securityContext:
            {{- include "miles.containerSecurityContext" . | nindent 12 }}
          # /healthz answers 503 until the environment is loaded (datasets, images: minutes): the startup probe
          # allows the job's rollout.environment.startup_timeout_s for it before the kubelet restarts the container.
          startupProbe:
            httpGet: {path: /healthz, port: http}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: ${ENV_SERVER_STARTUP_FAILURES}
          # Episodes run beside /healthz on the server's event loop: a server that stops answering for a minute is
          # hung and restarted (its in-flight episodes end ABORTED at the workers).
          livenessProbe:
            httpGet: {path: /healthz, port: http}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 6
          readinessProbe:
            httpGet: {path: /healthz, port: http}
            periodSeconds: 5
            timeoutSeconds: 3
          resources:
            {{- toYaml $e.resources | nindent 12 }}
          volumeMounts:
            - {name: tmp, mountPath: /tmp}
            {{- with $e.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {sizeLimit: {{ $e.tmpSize }}}
        {{- with $e.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}

{{/* What the job's rollout workers call: http://<fullname>-${JOB_ID}-env-server:<port> (replicas share episodes). */}}
{{- define "miles.job.envServerService" -}}
{{- $ctx := dict "root" . "component" "env-server" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "miles.job.name" $ctx }}
  labels:
    {{- include "miles.job.labels" $ctx | nindent 4 }}
spec:
  selector:
    {{- include "miles.job.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: http, port: {{ .Values.jobTemplates.envServer.port }}, targetPort: http, protocol: TCP, appProtocol: http}
{{- end -}}

{{/* Only the job's own rollout workers reach its environment server (egress: the shared env-server policy). */}}
{{- define "miles.job.envServerNetworkPolicy" -}}
{{ include "miles.job.ingressPolicy" (dict "root" . "target" "env-server") }}
{{- end -}}
