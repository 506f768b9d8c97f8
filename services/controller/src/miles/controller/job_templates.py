"""Instantiate the chart's per-job templates for one job (the Kubernetes backend's object factory).

The Helm chart renders every per-job object with the cluster's values filled in and `${PLACEHOLDERS}` left for
the job, and stores them in the ConfigMap `<fullname>-job-templates` (one YAML text per key). This module fills the
placeholders of one job, builds the job's spec ConfigMap and sets owner references. It knows nothing of Kubernetes
clients: the backend creates what it returns, in this order:

1. `job_spec_config_map(templates, params, files)`: the ConfigMap `<fullname>-<job>-spec`. Create it first.
   Then `job_tokens_secret(spec_config_map, tokens)`: the Secret `<fullname>-<job>-tokens` with the job's own
   capabilities (`sandbox-token`), read by its rollout workers.
2. `instantiate_job_templates(templates, params)`: every other object (engine pool, weight-sync, rollout workers,
   trainer, per-job NetworkPolicies, and for a job with an environment its environment server); for a job whose
   engines take per-job flags, pass them through `engine_args.with_engine_args(objects, args)`; then through
   `owned_by(objects, spec_config_map_created)` so that deleting the spec ConfigMap deletes the job.

**Placeholders** (`PLACEHOLDERS`), each filled from a `JobTemplateParams` field:

- `${JOB_ID}` (`job_id`): a DNS label of at most 20 characters. Object names `<fullname>-<job>-<component>`, the
  label `miles.dev/job`, the router pool of the job's engines, and every per-job process's `job_id`.
- `${MODEL_PATH}` (`model_path`): the HF checkpoint directory (under the chart's `jobTemplates.modelMountPath`),
  read by the engines, the trainer and weight-sync (`model_config_dir`); SGLang also accepts a Hub id.
- `${ENGINE_REPLICAS}` (`engine_replicas`): engine pods, i.e. this job's share of the rollout pool (the engine
  HPA's minimum when the chart autoscales engines: `engine-hpa.yaml`).
- `${ENGINE_GPUS}` (`engine_gpus`): `nvidia.com/gpu` per SGLang pod. `${TP_SIZE}` (`tp_size`): `--tp-size`.
- `${ENGINE_NODES}` (`engine_nodes`): pods (nodes) of one engine replica, `--nnodes` (multi-node engines only).
- `${ROLLOUT_WORKER_REPLICAS}` (`rollout_worker_replicas`): rollout-worker pods (the HPA's minimum when the chart
  autoscales them); `${ROLLOUT_WORKER_MAX_REPLICAS}` (`rollout_worker_max_replicas`, 0 = the replicas): its maximum.
- `${TRAINER_REPLICAS}` (`trainer_replicas`): trainer ranks = StatefulSet pods (`MILES_TRAINER_WORLD_SIZE`).
- `${TRAINER_GPUS}` (`trainer_gpus`): `nvidia.com/gpu` per trainer pod.

**Environment servers**: the templates whose keys start with `env-server-` are filled only for a job with
`JobTemplateParams.environment` (`rollout.environment`) and skipped for any other; their placeholders, the image
choice and the rollout workers' `MILES_ROLLOUT_ENVIRONMENT_URL` are `miles.controller.env_server_templates`'.

**Multi-node engines**: for a job whose engine replica spans nodes (`JobTemplateParams.engine_nodes` > 1), the
engine LeaderWorkerSet (ENGINE_LWS_TEMPLATE_KEY, rendered only when the chart enables `leaderWorkerSet`) is filled
instead of the engine Deployment; for any other job it is skipped (`miles.controller.backends.kubernetes_lws`).

**Shared engine pools**: for a job on one (`resources.engines.shared_pool`),
`miles.controller.backends.kubernetes_shared_pool` drops the engine and weight-sync objects from what this module
instantiates and gives the trainer the pool's adapter volume, read from the key SHARED_POOLS_KEY (data the chart
renders only when it declares pools, never instantiated).

**Node pools**: for a job that names one (`resources.<pool>.node_pool`),
`miles.controller.backends.kubernetes_placement` gives the workloads of that pool the placement the chart describes
for it under the key NODE_POOLS_KEY (the chart's `nodePools`; data, never instantiated).

**Inference pools** (judge, teacher: the spec's `inference_pools`): the templates whose keys start with
`inference-pool-` are skipped here and filled once per pool, with the pool's placeholders, by
`miles.controller.backends.kubernetes_inference_pools`.

**The spec ConfigMap** `<fullname>-<job>-spec` is mounted read-only at `/etc/miles/job` in every per-job pod. Keys
(all required, `{}` when a process needs nothing from the spec):

- `spec.json`: the job spec as submitted (for people and tools; no process reads it);
- `trainer.json`: `TrainerSettings` fields (`train`, `backend`, `publish` ...), via `MILES_TRAINER_CONFIG_FILE`;
- `rollout.json`: `RolloutSettings` fields, at least `{"rollout": {...}}`, via `MILES_ROLLOUT_CONFIG_FILE`;
- `weightsync.json`: `WeightsyncSettings` fields (`transport`, `pause_mode`, `max_engines_updating`,
  `snapshot_interval` ...), via `MILES_WEIGHTSYNC_CONFIG_FILE`, read by the origin and every daemon.

A JSON file ranks below the environment (`miles.common.settings`), so the fields the templates set by env win and
must not be put in the files: host and ports, `job_id`, addresses of shared services (buffer, session server,
sandbox, Redis, router), the operator token, `model_path`, `checkpoint_dir`, trainer `rank` / `world_size` /
`master_addr` / `master_port`, and weight-sync `router_url`, `pool`, `origin`, `peers_dns`, `engine_urls`,
`store_dir`, `store_url`, `work_dir`, `model_config_dir`. `JobAddresses` names the per-job endpoints (e.g. the
weight-sync origin, the trainer's publish target) for what the controller writes into the files or dials itself.
The chart decides the engine implementation for the whole release: `engine_kind_of(templates)` says which (`sglang`
or `cpu`), so that a job asking for the other one can be refused with a clear message.

**Per-job engine flags** are not placeholders: `miles.controller.engine_args.with_engine_args` appends them to the
args of the engine container (ENGINE_CONTAINER), after the chart's own, which win.

Limits: plain text substitution, so every placeholder value is validated (job ids are DNS labels, counts are small
integers, the model path is a single line without quotes) before it reaches the YAML; object names are checked
against Kubernetes' 63-character limit (52 for StatefulSets, whose pods carry a revision-hash label).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from miles.common.errors import InvalidArgumentError
from miles.controller.env_server_templates import (
    ENV_SERVER_COMPONENT,
    ENV_SERVER_TEMPLATE_PREFIX,
    EnvironmentServerParams,
    env_server_image_of,
    wired_to_env_server,
)

SPEC_TEMPLATE_KEY = "spec-configmap.yaml"
"""Key of the spec ConfigMap's skeleton in the templates ConfigMap (not instantiated with the other objects)."""

SHARED_POOLS_KEY = "shared-pools.json"
"""Key of the chart's shared engine pools (their adapter volumes), read for jobs on a shared pool
(`miles.controller.backends.kubernetes_shared_pool`), never instantiated; only present when the chart declares pools."""

NODE_POOLS_KEY = "node-pools.json"
"""Key of the release's node pools (the chart's `nodePools`: name -> nodeSelector, tolerations, affinity), read for
jobs that name a pool (`miles.controller.backends.kubernetes_placement`), never instantiated."""

INFERENCE_POOL_TEMPLATE_PREFIX = "inference-pool-"
"""Keys of the templates of one inference pool (judge, teacher): filled once per pool of a job with the pool's own
placeholders (`miles.controller.backends.kubernetes_inference_pools`), never by `instantiate_job_templates`."""

_DATA_KEYS = (SPEC_TEMPLATE_KEY, SHARED_POOLS_KEY, NODE_POOLS_KEY)
"""Keys of the templates ConfigMap that `instantiate_job_templates` does not fill."""

SPEC_FILES = ("spec.json", "trainer.json", "rollout.json", "weightsync.json")
"""Keys of the job's spec ConfigMap, mounted at SPEC_MOUNT_PATH."""

SPEC_MOUNT_PATH = "/etc/miles/job"

ENGINE_TEMPLATE_KEY = "engine-deployment.yaml"
ENGINE_LWS_TEMPLATE_KEY = "engine-leaderworkerset.yaml"
ENGINE_KIND_ANNOTATION = "miles.dev/engine-kind"
ENGINE_CONTAINER = "engine"
"""Name of the engine container in the engine Deployment's pod template (the chart's `miles.job.engineContainer`)."""

PLACEHOLDERS = (
    "JOB_ID",
    "MODEL_PATH",
    "ENGINE_REPLICAS",
    "ENGINE_GPUS",
    "TP_SIZE",
    "ENGINE_NODES",
    "ROLLOUT_WORKER_REPLICAS",
    "ROLLOUT_WORKER_MAX_REPLICAS",
    "TRAINER_REPLICAS",
    "TRAINER_GPUS",
)
"""Every placeholder the templates may use besides the environment server's (see the module docstring)."""

_PLACEHOLDER_RE = re.compile(r"\$\{([A-Z_]+)\}")
_JOB_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$")
_MODEL_PATH_RE = re.compile(r"^[A-Za-z0-9_./:@+=-]{1,512}$")
_MAX_COUNT = 4096
_MAX_NAME_CHARS = 63
_MAX_STATEFULSET_NAME_CHARS = 52


@dataclass(frozen=True)
class JobTemplateParams:
    """The per-job values of the templates. Counts are per job; GPUs are per pod."""

    job_id: str
    model_path: str
    engine_replicas: int
    engine_gpus: int
    tp_size: int
    rollout_worker_replicas: int
    trainer_replicas: int
    trainer_gpus: int
    rollout_worker_max_replicas: int = 0
    """Upper bound of the rollout workers' HPA (when the chart enables it); 0 = rollout_worker_replicas."""
    engine_nodes: int = 1
    """Pods (nodes) of one engine replica; above 1 the engine LeaderWorkerSet replaces the engine Deployment."""
    environment: EnvironmentServerParams | None = None
    """The job's environment server (a job with `rollout.environment`); None: the env-server templates are skipped."""

    def placeholders(self) -> dict[str, str]:
        """Every placeholder's value; raises InvalidArgumentError naming the field when one is out of range."""
        if not _JOB_ID_RE.match(self.job_id):
            raise InvalidArgumentError(
                f"job id {self.job_id!r} must be a DNS label of at most 20 characters (a-z, 0-9, '-')",
                field="job_id",
            )
        if not _MODEL_PATH_RE.match(self.model_path):
            raise InvalidArgumentError(
                f"model path {self.model_path!r} may only contain letters, digits and _./:@+=-", field="model_path"
            )
        max_workers = self.rollout_worker_max_replicas or self.rollout_worker_replicas
        counts = {
            "ENGINE_REPLICAS": (self.engine_replicas, 0),
            "ENGINE_GPUS": (self.engine_gpus, 0),
            "TP_SIZE": (self.tp_size, 1),
            "ENGINE_NODES": (self.engine_nodes, 1),
            "ROLLOUT_WORKER_REPLICAS": (self.rollout_worker_replicas, 0),
            "ROLLOUT_WORKER_MAX_REPLICAS": (max_workers, self.rollout_worker_replicas),
            "TRAINER_REPLICAS": (self.trainer_replicas, 0),
            "TRAINER_GPUS": (self.trainer_gpus, 0),
        }
        for name, (value, minimum) in counts.items():
            if not minimum <= value <= _MAX_COUNT:
                raise InvalidArgumentError(
                    f"{name.lower()} must be in [{minimum}, {_MAX_COUNT}], got {value}", field=name.lower()
                )
        return {
            "JOB_ID": self.job_id,
            "MODEL_PATH": self.model_path,
            **{name: str(value) for name, (value, _) in counts.items()},
            **(self.environment.placeholders() if self.environment is not None else {}),
        }


@dataclass(frozen=True)
class JobAddresses:
    """In-cluster endpoints of one job's objects, named as the chart names them (`<fullname>-<job>-<component>`)."""

    engine_service: str
    """Headless Service of the engines (its EndpointSlices carry `miles.dev/pool=<job>` for the router)."""
    weightsync_origin: str
    """host:port of the origin daemon: the trainer's publish target (PublishWeights) and the controller's
    GetVersion / WatchVersions target."""
    weightsync_peers_dns: str
    """name:port of the headless Service over the daemons next to the engines (the origin's peers_dns)."""
    trainer_rank0: str
    """host:port of trainer rank 0's gRPC API (Status, Checkpoint, Stop, WatchEvents)."""
    environment_url: str = ""
    """http://host:port of the environment-server Service (its rollout workers' `environment_url`, for a job with
    an environment); "" when the chart has no environment-server templates."""

    @classmethod
    def of(cls, templates: Mapping[str, str], job_id: str) -> JobAddresses:
        """The addresses of job `job_id` (ports as the chart's Services declare them)."""
        prefix = f"{fullname_of(templates)}-{job_id}"
        weightsync_port = _port(templates["weight-sync-origin-service.yaml"], "grpc")
        trainer_port = _port(templates["trainer-service.yaml"], "grpc")
        return cls(
            engine_service=f"{prefix}-engine",
            weightsync_origin=f"{prefix}-weight-sync-origin:{weightsync_port}",
            weightsync_peers_dns=f"{prefix}-weight-sync-peers:{weightsync_port}",
            trainer_rank0=f"{prefix}-trainer-0.{prefix}-trainer:{trainer_port}",
            environment_url=_environment_url(templates, job_id),
        )


def _environment_url(templates: Mapping[str, str], job_id: str) -> str:
    service = templates.get(f"{ENV_SERVER_TEMPLATE_PREFIX}service.yaml")
    if service is None:
        return ""
    return f"http://{fullname_of(templates)}-{job_id}-{ENV_SERVER_COMPONENT}:{_port(service, 'http')}"


def _port(service_template: str, name: str) -> int:
    service = yaml.safe_load(service_template)
    return next(int(port["port"]) for port in service["spec"]["ports"] if port["name"] == name)


def fullname_of(templates: Mapping[str, str]) -> str:
    """The chart's object-name prefix, read from the spec ConfigMap skeleton (`<fullname>-${JOB_ID}-spec`)."""
    skeleton = yaml.safe_load(templates[SPEC_TEMPLATE_KEY])
    name: str = skeleton["metadata"]["name"]
    return name.removesuffix("-${JOB_ID}-spec")


def engine_kind_of(templates: Mapping[str, str]) -> str:
    """The engine implementation the templates run (`sglang` or `cpu`, the chart's `jobTemplates.engine.kind`),
    from the engine Deployment's `miles.dev/engine-kind` annotation; "" for a chart that does not say."""
    engine = yaml.safe_load(templates.get(ENGINE_TEMPLATE_KEY, "")) or {}
    kind: str = engine.get("metadata", {}).get("annotations", {}).get(ENGINE_KIND_ANNOTATION, "")
    return kind


def _fill(template_name: str, text: str, values: Mapping[str, str]) -> list[dict[str, Any]]:
    def substitute(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in values:
            raise InvalidArgumentError(f"template {template_name} uses unknown placeholder ${{{key}}}")
        return values[key]

    filled = _PLACEHOLDER_RE.sub(substitute, text)
    return [document for document in yaml.safe_load_all(filled) if document]


def _check_name(obj: Mapping[str, Any]) -> None:
    name = str(obj["metadata"]["name"])
    limit = _MAX_STATEFULSET_NAME_CHARS if obj["kind"] == "StatefulSet" else _MAX_NAME_CHARS
    if len(name) > limit:
        raise InvalidArgumentError(
            f"{obj['kind']} name {name!r} is longer than {limit} characters: use a shorter job id", field="job_id"
        )


def instantiate_job_templates(templates: Mapping[str, str], params: JobTemplateParams) -> list[dict[str, Any]]:
    """Every object of every template except the spec ConfigMap, SHARED_POOLS_KEY and NODE_POOLS_KEY (data), keys
    sorted, placeholders filled; the environment server's (`env-server-*`) only for a job with an environment,
    whose workers are then wired to it; the inference pools' (INFERENCE_POOL_TEMPLATE_PREFIX) never.

    Raises InvalidArgumentError when a template uses a placeholder this version does not know (so that a chart
    newer than the controller fails loudly instead of creating objects with `${...}` in them), when a value is
    out of range, or when a name would exceed Kubernetes' limits.
    """
    values = params.placeholders()
    if "rollout-worker-hpa.yaml" in templates and params.rollout_worker_replicas < 1:
        raise InvalidArgumentError(
            "rollout_worker_replicas must be >= 1 when the chart autoscales rollout workers",
            field="rollout_worker_replicas",
        )
    if params.engine_nodes > 1 and ENGINE_LWS_TEMPLATE_KEY not in templates:
        raise InvalidArgumentError(
            f"the job templates have no {ENGINE_LWS_TEMPLATE_KEY} for engines of {params.engine_nodes} nodes: "
            "install the chart with leaderWorkerSet.enabled",
            field="engine_nodes",
        )
    if params.environment is not None:
        values["ENV_SERVER_IMAGE"] = env_server_image_of(templates, params.environment.connector)
    objects: list[dict[str, Any]] = []
    unused_engine = ENGINE_TEMPLATE_KEY if params.engine_nodes > 1 else ENGINE_LWS_TEMPLATE_KEY
    for name in sorted(templates):
        skipped = name == unused_engine or (params.environment is None and name.startswith(ENV_SERVER_TEMPLATE_PREFIX))
        skipped = skipped or name.startswith(INFERENCE_POOL_TEMPLATE_PREFIX)
        if name not in _DATA_KEYS and not skipped:
            objects += _fill(name, templates[name], values)
    for obj in objects:
        _check_name(obj)
    if params.environment is not None:
        objects = wired_to_env_server(objects, _environment_url(templates, params.job_id))
    return objects


def pod_specs_of(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs (the dicts themselves, to change in place) of a workload: a Deployment's, StatefulSet's or
    DaemonSet's, a LeaderWorkerSet's leader and worker; [] for any other kind."""
    if workload.get("kind") in ("Deployment", "StatefulSet", "DaemonSet"):
        return [workload["spec"]["template"]["spec"]]
    if workload.get("kind") == "LeaderWorkerSet":
        group = workload["spec"]["leaderWorkerTemplate"]
        return [group[key]["spec"] for key in ("leaderTemplate", "workerTemplate") if key in group]
    return []


def job_spec_config_map(
    templates: Mapping[str, str], params: JobTemplateParams, files: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The job's spec ConfigMap: the chart's skeleton (name, labels) with `files` (every key of SPEC_FILES,
    each a JSON object) as its data."""
    missing = sorted(set(SPEC_FILES) - set(files))
    unknown = sorted(set(files) - set(SPEC_FILES))
    if missing or unknown:
        raise InvalidArgumentError(
            f"spec files must be exactly {list(SPEC_FILES)} (missing {missing}, unknown {unknown})", field="files"
        )
    (config_map,) = _fill(SPEC_TEMPLATE_KEY, templates[SPEC_TEMPLATE_KEY], params.placeholders())
    config_map["data"] = {key: json.dumps(files[key], indent=2, sort_keys=True) for key in SPEC_FILES}
    _check_name(config_map)
    return config_map


def job_tokens_secret(spec_config_map: Mapping[str, Any], tokens: Mapping[str, str]) -> dict[str, Any]:
    """The job's Secret `<fullname>-<job>-tokens` (labels of the spec ConfigMap): the job's own capabilities,
    e.g. `sandbox-token`, which the templates read with secretKeyRef. Create it before the pods that read it."""
    metadata = spec_config_map["metadata"]
    name = f"{metadata['name'].removesuffix('-spec')}-tokens"
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": dict(metadata.get("labels", {}))},
        "type": "Opaque",
        "stringData": dict(tokens),
    }
    _check_name(secret)
    return secret


def owned_by(objects: list[dict[str, Any]], owner: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`objects` with an ownerReference to `owner` (the created spec ConfigMap: needs metadata.uid), so that
    Kubernetes' garbage collector deletes them with it. Returns new dicts; the input is not changed."""
    uid = owner.get("metadata", {}).get("uid")
    if not uid:
        raise InvalidArgumentError("the owner has no metadata.uid: create it first", field="owner")
    reference = {
        "apiVersion": owner.get("apiVersion", "v1"),
        "kind": owner.get("kind", "ConfigMap"),
        "name": owner["metadata"]["name"],
        "uid": uid,
    }
    owned = []
    for obj in objects:
        metadata = {**obj["metadata"], "ownerReferences": [*obj["metadata"].get("ownerReferences", []), reference]}
        owned.append({**obj, "metadata": metadata})
    return owned
