{{/*
The network flows of DESIGN.md §1, as data: who may open connections to whom, on which named port.
"perJob" flows stay inside one job (the per-job NetworkPolicy enforces that); the others are platform-wide.
NetworkPolicies (shared and per job) are generated from this list; tests compare it with the design.
*/}}
{{- define "miles.flows" -}}
- {from: rollout-worker, to: session-server, port: http}
- {from: controller, to: session-server, port: http}
- {from: session-server, to: rollout-router, port: http}
- {from: weight-sync, to: rollout-router, port: http}
- {from: weight-sync, to: rollout-router, port: admin}
- {from: controller, to: rollout-router, port: http}
- {from: controller, to: rollout-router, port: admin}
- {from: rollout-worker, to: buffer, port: grpc}
- {from: trainer, to: buffer, port: grpc}
- {from: controller, to: buffer, port: grpc}
- {from: rollout-worker, to: sandbox-gateway, port: grpc}
- {from: controller, to: redis, port: redis}
- {from: session-server, to: redis, port: redis}
- {from: buffer, to: redis, port: redis}
- {from: rollout-worker, to: redis, port: redis}
- {from: rollout-router, to: engine, port: http}
- {from: weight-sync, to: engine, port: http, perJob: true}
- {from: trainer, to: engine, port: http, perJob: true}
- {from: trainer, to: weight-sync, port: grpc, perJob: true}
- {from: controller, to: weight-sync, port: grpc}
- {from: controller, to: trainer, port: grpc}
- {from: trainer, to: trainer, port: dist, perJob: true}
{{- end -}}

{{/* Components that are per job (their ingress is enforced by the per-job NetworkPolicy). */}}
{{- define "miles.perJobComponents" -}}
- engine
- weight-sync
- trainer
- rollout-worker
{{- end -}}

{{/* The pod component that runs a logical component: weight-sync runs inside engine pods in sidecar mode. */}}
{{- define "miles.podComponent" -}}
{{- if and (eq .component "weight-sync") (eq .root.Values.jobTemplates.weightSync.mode "sidecar") -}}
engine
{{- else -}}
{{ .component }}
{{- end -}}
{{- end -}}
