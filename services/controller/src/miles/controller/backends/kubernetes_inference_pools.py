"""A job's inference pools on Kubernetes (`inference_pools`: a judge, a teacher, a reward model).

Each pool gets the chart's inference-pool templates (job-templates keys `inference-pool-*`,
`job_templates.INFERENCE_POOL_TEMPLATE_PREFIX`; helm/miles/templates/job/_inference_pool.tpl), filled with the job's
`${JOB_ID}` and the pool's placeholders (POOL_PLACEHOLDERS): a Deployment `<fullname>-<job>-pool-<name>` of engines
of the pool's model (the release's engine kind and image, no weight-sync, never resized) and a headless Service
labelled `miles.dev/pool: <job>--<name>` (`inference_pool_router_name`), whose EndpointSlices the router discovers as
that router pool. The backend creates them with the job's other objects, owned by the job's spec ConfigMap (deleting
the job deletes them). The pieces of the seam that are not objects:

- the session server: the controller registers a job config `<job>--<name>` per pool (`shared.JobRegistry.register`,
  the same for both backends): the pool's model, TITO family and chat-template kwargs, engine pool `<job>--<name>`;
- the rollout workers: `inference_pools` (name -> `<job>--<name>`, for `miles.rollout.pools.pool_session`) and
  `teacher_pool` (the distillation teacher's router pool) in their rollout.json (`inference_pool_files`), as the
  local backend passes them by env; the router URL is the chart's env;
- `observe`: `pools["inference_engines"]` counts the pools' ready engines (`ready_inference_engines`), and a job is
  RUNNING only once every pool has all its engines (`num_inference_engines`).

A pool's `node_pool`, when the spec sets it, places its pods as `kubernetes_placement` places a job's (the node
pool's nodeSelector, tolerations, affinity); left unset, they keep the chart's placement for the engine kind (the
rollout pool for SGLang, the cpu pool for miles-engine). Its `extra_args` are appended to the engine's args unless
the chart's extraArgs name the flag (the chart wins).

Limits: `inference_pool_problem` refuses (400, naming the pool's field) a kind other than the release's engine kind
(the chart renders one engine image), an SGLang pool with fewer GPUs than its tp_size, a node pool the release does
not define, and a chart without the templates (older than this controller). A job with both `kueue` and inference
pools is refused in `kubernetes_limits` (the Workload would need a podSet per pool). Pools are never resized by
`PATCH /v1/jobs/{id}`; an adopted Deployment (409 after a controller restart) keeps the args it was created with.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import yaml
from kubernetes import client as k8s

from miles.common.errors import InvalidArgumentError
from miles.common.jobspec.job import JobSpec
from miles.common.jobspec.pools import InferencePoolSpec, inference_pool_router_name
from miles.controller.backends.kubernetes_placement import NodePlacement, chart_node_pools
from miles.controller.engine_args import names_flag
from miles.controller.job_templates import (
    ENGINE_CONTAINER,
    INFERENCE_POOL_TEMPLATE_PREFIX,
    engine_kind_of,
    pod_specs_of,
)

DEPLOYMENT_KEY = f"{INFERENCE_POOL_TEMPLATE_PREFIX}deployment.yaml"
SERVICE_KEY = f"{INFERENCE_POOL_TEMPLATE_PREFIX}service.yaml"
COMPONENT = "inference-engine"
"""Component label of the pools' engine pods (not `engine`: the job's engine Service must not select them)."""
POOL_LABEL = "miles.dev/inference-pool"
POOL_PLACEHOLDERS = ("POOL_NAME", "ROUTER_POOL", "POOL_MODEL_PATH", "POOL_REPLICAS", "POOL_GPUS", "POOL_TP_SIZE")
"""The placeholders of the inference-pool templates besides `${JOB_ID}`."""

_COMPONENT_LABEL = "app.kubernetes.io/component"
_JOB_LABEL = "miles.dev/job"
_PLACEHOLDER_RE = re.compile(r"\$\{([A-Z_]+)\}")
_MODEL_PATH_RE = re.compile(r"^[A-Za-z0-9_./:@+=-]{1,512}$")
_MAX_NAME_CHARS = 63


def inference_pool_problem(spec: JobSpec, templates: Mapping[str, str]) -> tuple[str, str] | None:
    """(field, why) of the first inference pool of `spec` this release cannot run; None when it can run them all."""
    if spec.inference_pools and not {DEPLOYMENT_KEY, SERVICE_KEY} <= set(templates):
        return "inference_pools", (
            "this release's chart has no inference-pool templates (it is older than this controller): upgrade the "
            "chart to run judge / teacher pools on Kubernetes"
        )
    chart_kind = engine_kind_of(templates)
    node_pools = chart_node_pools(templates)
    for index, pool in enumerate(spec.inference_pools):
        field = f"inference_pools[{index}]"
        if chart_kind and pool.kind != chart_kind:
            return f"{field}.kind", (
                f"inference pool {pool.name!r} asks for kind {pool.kind!r} but this release's chart runs "
                f"{chart_kind!r} engines (jobTemplates.engine.kind, the one engine image it renders); submit the pool "
                f"with kind {chart_kind!r}"
            )
        if pool.kind == "sglang" and pool.gpus_per_replica < pool.tp_size:
            return f"{field}.gpus_per_replica", (
                f"inference pool {pool.name!r}: an SGLang engine of tp_size {pool.tp_size} needs at least that many "
                f"GPUs per replica, got gpus_per_replica={pool.gpus_per_replica}"
            )
        if _names_node_pool(pool) and pool.node_pool not in node_pools:
            return f"{field}.node_pool", (
                f"{field}.node_pool {pool.node_pool!r} is not a node pool of this release (the chart's nodePools: "
                f"{sorted(node_pools)}); name one of them, or leave it unset for the chart's placement"
            )
        if not _MODEL_PATH_RE.match(pool.model_path):
            return f"{field}.model_path", (
                f"inference pool {pool.name!r}: model path {pool.model_path!r} may only contain letters, digits and "
                "_./:@+=-"
            )
    return None


def _names_node_pool(pool: InferencePoolSpec) -> bool:
    """Whether the spec sets the pool's node_pool (else the chart's placement for the engine kind applies)."""
    return "node_pool" in pool.model_fields_set


def inference_pool_objects(templates: Mapping[str, str], job_id: str, spec: JobSpec) -> list[dict[str, Any]]:
    """The Deployment and Service of every inference pool of `spec` (none without pools), placed and with the
    pool's extra args. Check `inference_pool_problem` first (a missing template or node pool raises KeyError);
    raises InvalidArgumentError when a name would exceed Kubernetes' 63 characters."""
    objects: list[dict[str, Any]] = []
    for pool in spec.inference_pools:
        values = _placeholders(job_id, pool)
        for key in (DEPLOYMENT_KEY, SERVICE_KEY):
            for obj in _filled(key, templates[key], values):
                if obj["kind"] == "Deployment":
                    obj = _with_pool_settings(obj, pool, chart_node_pools(templates))
                _check_name(obj)
                objects.append(obj)
    return objects


def _placeholders(job_id: str, pool: InferencePoolSpec) -> dict[str, str]:
    return {
        "JOB_ID": job_id,
        "POOL_NAME": pool.name,
        "ROUTER_POOL": inference_pool_router_name(job_id, pool.name),
        "POOL_MODEL_PATH": pool.model_path,
        "POOL_REPLICAS": str(pool.replicas),
        "POOL_GPUS": str(pool.gpus_per_replica),
        "POOL_TP_SIZE": str(pool.tp_size),
    }


def _filled(key: str, text: str, values: Mapping[str, str]) -> list[dict[str, Any]]:
    def substitute(match: re.Match[str]) -> str:
        if match.group(1) not in values:
            raise InvalidArgumentError(f"template {key} uses unknown placeholder ${{{match.group(1)}}}")
        return values[match.group(1)]

    return [document for document in yaml.safe_load_all(_PLACEHOLDER_RE.sub(substitute, text)) if document]


def _with_pool_settings(
    deployment: dict[str, Any], pool: InferencePoolSpec, node_pools: Mapping[str, NodePlacement]
) -> dict[str, Any]:
    """The pool's Deployment with its extra args on the engine container and, when it names one, its node pool."""
    placed = copy.deepcopy(deployment)
    for pod_spec in pod_specs_of(placed):
        for container in pod_spec["containers"]:
            if container.get("name") == ENGINE_CONTAINER:
                present = list(container.get("args", []))
                container["args"] = present + [arg for arg in pool.extra_args if not names_flag(present, arg)]
        if _names_node_pool(pool):
            _place(pod_spec, node_pools[pool.node_pool])
    return placed


def _place(pod_spec: dict[str, Any], placement: NodePlacement) -> None:
    parts = {"nodeSelector": placement.node_selector, "tolerations": placement.tolerations}
    for key, value in {**parts, "affinity": placement.affinity}.items():
        if value:
            pod_spec[key] = copy.deepcopy(value)
        else:
            pod_spec.pop(key, None)


def _check_name(obj: Mapping[str, Any]) -> None:
    name = str(obj["metadata"]["name"])
    if len(name) > _MAX_NAME_CHARS:
        raise InvalidArgumentError(
            f"{obj['kind']} name {name!r} is longer than {_MAX_NAME_CHARS} characters: use a shorter job id or "
            "inference pool name",
            field="inference_pools",
        )


def inference_pool_files(files: Mapping[str, dict[str, Any]], job_id: str, spec: JobSpec) -> dict[str, dict[str, Any]]:
    """The job's spec files with the rollout workers' `inference_pools` and `teacher_pool` in rollout.json (what the
    local backend sets by env); unchanged for a job without pools."""
    if not spec.inference_pools:
        return dict(files)
    distillation = spec.train.distillation
    rollout = {
        **files["rollout.json"],
        "inference_pools": {pool.name: inference_pool_router_name(job_id, pool.name) for pool in spec.inference_pools},
        "teacher_pool": inference_pool_router_name(job_id, distillation.teacher_pool) if distillation else "",
    }
    return {**files, "rollout.json": rollout}


def num_inference_engines(spec: JobSpec) -> int:
    """Engines of all the job's inference pools (what `observe` waits for before RUNNING)."""
    return sum(pool.replicas for pool in spec.inference_pools)


def ready_inference_engines(apps: k8s.AppsV1Api, namespace: str, job_id: str) -> int:
    """Ready engines of all the job's inference pools (0 while none exist). Blocking: run it in a worker thread."""
    selector = f"{_JOB_LABEL}={job_id},{_COMPONENT_LABEL}={COMPONENT}"
    deployments = apps.list_namespaced_deployment(namespace, label_selector=selector)
    return sum(int((item.status and item.status.ready_replicas) or 0) for item in deployments.items)
