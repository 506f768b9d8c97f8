{{/*
The network flows of docs/architecture.md §1, as data: who may open connections to whom, on which named port ("any": every
port, for torch.distributed, whose NCCL/gloo connections use ephemeral ports beyond the rendezvous port; with
"except": every port but that number).
"perJob" flows stay inside one job (the per-job NetworkPolicy enforces that); the others are platform-wide.
NetworkPolicies (shared and per job) are generated from this list; tests compare it with the design.
Logical components map to pods through miles.podComponent (weight-sync runs in engine pods in sidecar mode).
*/}}
{{- define "miles.flows" -}}
- {from: rollout-worker, to: session-server, port: http}
- {from: controller, to: session-server, port: http}
- {from: session-server, to: rollout-router, port: http}
# weight-sync drains and undrains engines through the router's HTTP admin mirror (/admin/v1).
- {from: weight-sync, to: rollout-router, port: http}
- {from: weight-sync-origin, to: rollout-router, port: http}
- {from: controller, to: rollout-router, port: http}
- {from: controller, to: rollout-router, port: admin}
# The barrier of train.mode sync reads the engines' version (GET /v1/weight_version).
- {from: rollout-worker, to: rollout-router, port: http}
- {from: rollout-worker, to: buffer, port: grpc}
- {from: trainer, to: buffer, port: grpc}
- {from: controller, to: buffer, port: grpc}
- {from: rollout-worker, to: sandbox-gateway, port: grpc}
# The sandbox gateway's HTTP facade (sandbox_http_url, for agents without gRPC) shares its metrics port.
- {from: rollout-worker, to: sandbox-gateway, port: metrics}
- {from: controller, to: redis, port: redis}
- {from: session-server, to: redis, port: redis}
- {from: buffer, to: redis, port: redis}
- {from: rollout-worker, to: redis, port: redis}
- {from: rollout-router, to: engine, port: http}
# A job's inference pools (judge, teacher): the router serves their sessions and the teacher's scoring.
- {from: rollout-router, to: inference-engine, port: http}
# Weight loads (/update_weights_*, pause, version) by the daemon next to the engine.
- {from: weight-sync, to: engine, port: http, perJob: true}
# The nccl transport runs in the trainer and sets up its update groups over the engines' HTTP API...
- {from: trainer, to: engine, port: http, perJob: true}
# ...and the engines join those groups on the trainer (rendezvous from weightUpdatePort, then NCCL's own ports), but
# never the ranks' rendezvous store on masterPort (unauthenticated; it also carries the ranks' heartbeats).
- {from: engine, to: trainer, port: any, except: {{ .Values.jobTemplates.trainer.masterPort }}, perJob: true}
# PublishWeights / OpenPublishChannel + CommitPublish: the trainer publishes every version to the job's origin...
- {from: trainer, to: weight-sync-origin, port: grpc, perJob: true}
# ...its tensors over the origin's raw TCP data channel (the same listener daemons fetch full weights from).
- {from: trainer, to: weight-sync-origin, port: data, perJob: true}
# FetchStoredVersion / FetchWeights: daemons copy versions from the origin.
- {from: weight-sync, to: weight-sync-origin, port: grpc, perJob: true}
# OpenDataChannel's raw TCP data channel: daemons pull a version's full tensors from the origin (stream transport).
- {from: weight-sync, to: weight-sync-origin, port: data, perJob: true}
# UpdateEngines: the origin rolls each version through the daemons (peers_dns).
- {from: weight-sync-origin, to: weight-sync, port: grpc, perJob: true}
- {from: controller, to: weight-sync-origin, port: grpc}
- {from: controller, to: trainer, port: grpc}
# The ranks of one job: the rendezvous store on masterPort (rank 0), then gloo's/NCCL's own ports.
- {from: trainer, to: trainer, port: any, perJob: true}
# Hub environments (jobs with rollout.environment): the job's workers run each episode on the job's environment
# server (POST /v1/episodes; also /healthz, /v1/info, /v1/rows)...
- {from: rollout-worker, to: env-server, port: http, perJob: true}
# ...which calls the model through the session's OpenAI endpoint (the episode's base_url, the session server)...
- {from: env-server, to: session-server, port: http}
# ...and runs a task's commands in the job's sandboxes (Harbor: gRPC, or the HTTP facade on the metrics port).
- {from: env-server, to: sandbox-gateway, port: grpc}
- {from: env-server, to: sandbox-gateway, port: metrics}
{{- if .Values.leaderWorkerSet.enabled }}
# Multi-node engines (leaderWorkerSet): the pods of one SGLang server, its leader (engine) and workers
# (engine-worker), rendezvous at the leader's distInitPort, then open NCCL's/gloo's own ports, every way...
- {from: engine-worker, to: engine, port: any, perJob: true}
- {from: engine, to: engine-worker, port: any, perJob: true}
- {from: engine-worker, to: engine-worker, port: any, perJob: true}
# ...and every rank joins the trainer's weight-update groups (nccl transport), as the leader does.
- {from: engine-worker, to: trainer, port: any, except: {{ .Values.jobTemplates.trainer.masterPort }}, perJob: true}
{{- end }}
{{- if .Values.sharedPools }}
# Shared LoRA engine pools (sharedPools): the router serves every job on the pool from its engines...
- {from: rollout-router, to: shared-engine, port: http}
# ...and the trainer of any job placed on it loads each adapter version into them (/load_lora_adapter, under the
# engine admin key), finding them through the router's admin API, then makes the version live at the session
# server (PUT /v1/jobs/{id}/adapter, under the session operator token). Not per job: the pool is the platform's.
- {from: trainer, to: shared-engine, port: http}
- {from: trainer, to: rollout-router, port: http}
- {from: trainer, to: session-server, port: http}
{{- end }}
{{- end -}}

{{/* Pod components of per-job objects (their ingress is enforced per job by the per-job NetworkPolicy). */}}
{{- define "miles.perJobComponents" -}}
- engine
- weight-sync
- weight-sync-origin
- trainer
- rollout-worker
- env-server
- inference-engine
{{- if .Values.leaderWorkerSet.enabled }}
- engine-worker
{{- end }}
{{- end -}}

{{/* The pod component that runs a logical component: weight-sync runs inside engine pods in sidecar mode. */}}
{{- define "miles.podComponent" -}}
{{- if and (eq .component "weight-sync") (eq .root.Values.jobTemplates.weightSync.mode "sidecar") -}}
engine
{{- else -}}
{{ .component }}
{{- end -}}
{{- end -}}

{{/* Every pod component of the platform (shared, per job, and the shared pools' engines), as a YAML list. */}}
{{- define "miles.podComponents" -}}
{{- $all := list "controller" "session-server" "rollout-router" "buffer" "sandbox-gateway" "redis" "engine" "weight-sync" "weight-sync-origin" "trainer" "rollout-worker" "env-server" "inference-engine" -}}
{{- if .Values.sharedPools }}{{ $all = append $all "shared-engine" }}{{ end -}}
{{- if .Values.leaderWorkerSet.enabled }}{{ $all = append $all "engine-worker" }}{{ end -}}
{{- $pods := list -}}
{{- range $all }}{{ $pods = append $pods (include "miles.podComponent" (dict "root" $ "component" .)) }}{{ end -}}
{{- toYaml ($pods | uniq) -}}
{{- end -}}

{{/* Named ports Prometheus scrapes on a pod component (none on Redis and on environment servers). */}}
{{- define "miles.metricsPorts" -}}
{{- if has .component (list "controller" "session-server" "rollout-router" "rollout-worker") -}}
[http]
{{- else if has .component (list "shared-engine" "inference-engine") -}}
[http]
{{- else if eq .component "engine" -}}
{{- if eq .root.Values.jobTemplates.weightSync.mode "sidecar" }}[http, metrics]{{ else }}[http]{{ end -}}
{{- else if has .component (list "redis" "env-server" "engine-worker") -}}
[]
{{- else -}}
[metrics]
{{- end -}}
{{- end -}}

{{/* A NetworkPolicy port list for a flow port ("any" = no ports field: every port; "except": the ranges around it). */}}
{{- define "miles.flowPorts" -}}
{{- if .except -}}
ports: [{protocol: TCP, port: 1, endPort: {{ sub .except 1 }}}, {protocol: TCP, port: {{ add .except 1 }}, endPort: 65535}]
{{- else if ne .port "any" -}}
ports: [{protocol: TCP, port: {{ .port }}}]
{{- end -}}
{{- end -}}

{{/* daemonset mode puts engines on the host network: flows to them go to the node CIDRs. */}}
{{- define "miles.enginesOnHostNetwork" -}}
{{- if eq .Values.jobTemplates.weightSync.mode "daemonset" }}true{{ end -}}
{{- end -}}
