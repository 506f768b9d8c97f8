{{/*
Shared LoRA engine pools (values sharedPools): engines of one base model that serve the LoRA adapters of every job
placed on them (a job names the pool in resources.engines.shared_pool). Unlike a job's engines they are the
platform's: installed with the release, sized by the values, never created or deleted by the controller. Per pool:

- a Deployment <fullname>-pool-<name> of engines (the release's jobTemplates.engine kind, image, node pool and
  resources; miles.engineContainer) with the pool's LoRA flags, and the pool's adapter volume mounted read-only at
  adapterMountPath, where each job's trainer writes its adapter versions (<adapterMountPath>/<job id>/);
- a headless Service of the same name whose EndpointSlices the router discovers exactly as a job's: labelled
  app.kubernetes.io/component=engine (the router's k8s_label_selector) and miles.dev/pool=<name> (the router pool);
- a PodDisruptionBudget (one engine at a time).

The pods' own component is shared-engine, not engine: their NetworkPolicies admit the router and the trainer of any
job (the pool is no one job's), while a job's engines admit only that job's pods. The controller learns the pools
from MILES_CONTROLLER_SHARED_POOLS (miles.sharedPools.controllerJson) and where a trainer mounts a pool's adapter
volume from shared-pools.json in the job-templates ConfigMap (miles.sharedPools.templatesJson).
*/}}

{{/*
The pools with their defaults, as a JSON list (the one place defaults are applied, so the engines' flags and the
controller's view agree). Fails on a name used twice and on a name too long for the pool's object names.
*/}}
{{- define "miles.sharedPools" -}}
{{- $pools := list -}}
{{- $names := list -}}
{{- $linear := list "q_proj" "k_proj" "v_proj" "o_proj" "gate_proj" "up_proj" "down_proj" -}}
{{- range .Values.sharedPools -}}
{{- if has .name $names }}{{ fail (printf "sharedPools: the name %q is used twice" .name) }}{{ end -}}
{{- $names = append $names .name -}}
{{- $objectName := printf "%s-pool-%s" (include "miles.fullname" $) .name -}}
{{- if gt (len $objectName) 63 -}}
{{- fail (printf "sharedPools: %q is longer than 63 characters (the pool's Deployment and Service name): use a shorter pool name" $objectName) -}}
{{- end -}}
{{- $pools = append $pools (dict
  "name" .name
  "objectName" $objectName
  "modelPath" .modelPath
  "replicas" (.replicas | default 1)
  "maxLoadedLoras" (.maxLoadedLoras | default 8)
  "maxLoraRank" (.maxLoraRank | default 64)
  "loraTargetModules" (.loraTargetModules | default $linear)
  "extraArgs" (.extraArgs | default list)
  "tpSize" (.tpSize | default 1)
  "gpusPerReplica" (.gpusPerReplica | default 1)
  "adapterVolume" .adapterVolume
  "adapterMountPath" (.adapterMountPath | default "/adapters")) -}}
{{- end -}}
{{- toJson $pools -}}
{{- end -}}

{{- define "miles.sharedPool.selectorLabels" -}}
{{ include "miles.selectorLabels" (dict "root" .root "component" "shared-engine") }}
miles.dev/shared-pool: {{ .pool.name }}
{{- end -}}

{{- define "miles.sharedPool.labels" -}}
{{ include "miles.labels" (dict "root" .root "component" "shared-engine") }}
miles.dev/shared-pool: {{ .pool.name }}
{{- end -}}

{{/* The engines' arguments after the chart's extraArgs: SharedPool.engine_args() of the controller, then extraArgs. */}}
{{- define "miles.sharedPool.engineArgs" -}}
{{- $p := .pool -}}
{{- $loras := int $p.maxLoadedLoras | toString -}}
{{- $args := list "--enable-lora" "--max-loaded-loras" $loras "--max-loras-per-batch" $loras "--max-lora-rank" (int $p.maxLoraRank | toString) "--lora-target-modules" -}}
{{- toJson (concat $args $p.loraTargetModules $p.extraArgs) -}}
{{- end -}}

{{/* MILES_CONTROLLER_SHARED_POOLS: the pools as ControllerSettings.shared_pools reads them (extraArgs stay here). */}}
{{- define "miles.sharedPools.controllerJson" -}}
{{- $pools := list -}}
{{- range include "miles.sharedPools" . | fromJsonArray -}}
{{- $pools = append $pools (dict "name" .name "model_path" .modelPath "replicas" (int .replicas) "max_loaded_loras" (int .maxLoadedLoras) "max_lora_rank" (int .maxLoraRank) "lora_target_modules" .loraTargetModules) -}}
{{- end -}}
{{- toJson $pools -}}
{{- end -}}

{{/*
shared-pools.json of the job-templates ConfigMap (miles.controller.backends.kubernetes_shared_pool): per pool, its
Deployment (whose ready engines the controller reports) and the claim and mount path of its adapter volume, which
the controller mounts into the trainer of a job on the pool (subPath <job id>); and the release Secret the trainer
reads the session operator token from.
*/}}
{{- define "miles.sharedPools.templatesJson" -}}
{{- $pools := dict -}}
{{- range include "miles.sharedPools" . | fromJsonArray -}}
{{- $_ := set $pools .name (dict "deployment" .objectName "adapterClaimName" .adapterVolume "adapterMountPath" .adapterMountPath) -}}
{{- end -}}
{{- toJson (dict "secretName" (include "miles.secretName" .) "pools" $pools) -}}
{{- end -}}
