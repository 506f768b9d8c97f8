"""The Kubernetes backend's half of shared LoRA engine pools: a job on one (`resources.engines.shared_pool`) runs no
engines of its own.

The chart runs every pool of its `sharedPools` (templates/shared-pools: a Deployment `<fullname>-pool-<name>` of
engines with the LoRA flags and the pool's adapter volume mounted read-only at its mount path, and a Service the
router discovers as the router pool `<name>`), hands the controller the pools (`shared_pools`), and describes each
pool's Deployment and adapter volume, and the release Secret, in the job-templates ConfigMap under
`job_templates.SHARED_POOLS_KEY`. For a job on a pool this module:

- drops the objects of the job's own engines from its instantiated templates: the engine Deployment, Service and
  NetworkPolicy, the weight-sync origin, its peers Service and daemons (OWN_ENGINE_COMPONENTS);
- makes its trainer publish adapters (`publish.kind: adapter` in trainer.json, miles.trainer.publish_adapters) into
  the pool: `pool` (the env MILES_TRAINER_PUBLISH__POOL, which the chart sets to the job id) is the shared pool, the
  router is the shared one (the chart's env), `session_url` the session server, told each live version with the
  session operator token (a secretKeyRef on the release Secret: only these trainers get it), and `dir`
  `<mount path>/<job id>`, where the trainer mounts the subdirectory `<job id>` of the pool's adapter volume: the
  engines see the whole volume at the mount path, so the path the trainer writes is the path they load, and a
  trainer can write only its own job's directory;
- reads the pool's ready engines for `observe`, which reports them without waiting for them (they are the
  platform's: the job neither starts nor sizes them).

Limits: the pool's engines are never resized or stopped here (the chart sizes them); a pool removed from the chart
while jobs run on it leaves those trainers publishing into nothing until they fail; the adapter directories stay on
the volume after the job ends; the kubelet creates the subdirectory `<job id>` (subPath), so the volume must let the
pods' group (fsGroup 10001) write there, as jobTemplates.trainer.checkpoints.sharedClaimName must.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from miles.common.errors import FailedPreconditionError, InvalidArgumentError
from miles.common.jobspec.job import JobSpec
from miles.controller.backends.base import SharedServices
from miles.controller.job_templates import SHARED_POOLS_KEY

FIELD = "resources.engines.shared_pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
OWN_ENGINE_COMPONENTS = frozenset({"engine", "weight-sync", "weight-sync-origin", "weight-sync-peers"})
"""Components of the per-job objects a job on a shared pool does without (its engines and their weight-sync)."""

ADAPTER_VOLUME = "shared-pool-adapters"
"""Name of the pool's adapter volume in the trainer's pod."""
TRAINER_CONTAINER = "trainer"
POOL_ENV = "MILES_TRAINER_PUBLISH__POOL"
ORIGIN_ENV = "MILES_TRAINER_PUBLISH__WEIGHTSYNC_ADDRESS"
SESSION_TOKEN_ENV = "MILES_TRAINER_SESSION_OPERATOR_TOKEN"
SESSION_TOKEN_KEY = "session-operator-token"
"""Key of the session operator token in the release Secret (the chart's auth values)."""


@dataclass(frozen=True)
class ChartPool:
    """What the chart says of one shared pool (SHARED_POOLS_KEY)."""

    deployment: str
    """Name of the pool's engine Deployment."""
    adapter_claim_name: str
    """The ReadWriteMany PVC the pool's engines read adapters from."""
    adapter_mount_path: str
    """Where the engines mount it; a job's trainer mounts its subdirectory `<job id>` at `<this>/<job id>`."""
    secret_name: str
    """The release Secret (holds the session operator token)."""

    def publish_dir(self, job_id: str) -> str:
        return f"{self.adapter_mount_path.rstrip('/')}/{job_id}"


def chart_pool(templates: Mapping[str, str], name: str) -> ChartPool | None:
    """The chart's pool `name`, or None when the chart declares no such pool."""
    if SHARED_POOLS_KEY not in templates:
        return None
    data = json.loads(templates[SHARED_POOLS_KEY])
    pool = data.get("pools", {}).get(name)
    if pool is None:
        return None
    return ChartPool(
        deployment=pool["deployment"],
        adapter_claim_name=pool["adapterClaimName"],
        adapter_mount_path=pool["adapterMountPath"],
        secret_name=data["secretName"],
    )


def check_pool_declared(spec: JobSpec, shared: SharedServices) -> None:
    """InvalidArgumentError (field resources.engines.shared_pool) when the job names a pool the controller does not
    declare, or when there is no session server to make its adapter versions live at."""
    name = spec.resources.engines.shared_pool
    if name is None:
        return
    if shared.shared_pool(name) is None:
        declared = [pool.name for pool in shared.shared_pools]
        raise InvalidArgumentError(
            f"no shared engine pool {name!r} is declared (the chart's sharedPools: {declared})", field=FIELD
        )
    if not shared.session_url:
        raise InvalidArgumentError(
            "a job on a shared engine pool makes each adapter version live at the session server, and this "
            "controller has none (session_url)",
            field=FIELD,
        )


def check_pool_in_chart(spec: JobSpec, templates: Mapping[str, str]) -> None:
    """InvalidArgumentError when the chart's job templates do not describe the job's pool (a controller setting
    without the chart's sharedPools entry, or a chart older than shared pools)."""
    name = spec.resources.engines.shared_pool
    if name is not None and chart_pool(templates, name) is None:
        raise InvalidArgumentError(
            f"the chart declares no shared engine pool {name!r} (its sharedPools, rendered into the job templates): "
            "declare the pool in the chart's sharedPools, which also sets the controller's shared_pools",
            field=FIELD,
        )


def place_on_shared_pool(
    templates: Mapping[str, str],
    job_id: str,
    spec: JobSpec,
    shared: SharedServices,
    objects: list[dict[str, Any]],
    files: Mapping[str, dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The job's objects and spec files for a job on its shared pool (see the module docstring). Raises
    FailedPreconditionError when the pool is gone from the settings or the chart since the job was accepted."""
    name = spec.resources.engines.shared_pool
    pool = chart_pool(templates, name) if name is not None else None
    if name is None or pool is None or shared.shared_pool(name) is None:
        raise FailedPreconditionError(
            f"the shared engine pool {name!r} is no longer declared (the chart's sharedPools, which also set the "
            "controller's shared_pools)"
        )
    kept = [obj for obj in objects if _component(obj) not in OWN_ENGINE_COMPONENTS]
    trainers = [i for i, obj in enumerate(kept) if obj["kind"] == "StatefulSet" and _component(obj) == "trainer"]
    if len(trainers) != 1:
        raise FailedPreconditionError(
            "the job templates have no trainer StatefulSet: the chart and this controller do not match"
        )
    kept[trainers[0]] = _adapter_publishing_trainer(kept[trainers[0]], job_id, name, pool)
    publish = {
        "kind": "adapter",
        "dtype": spec.weight_sync.dtype,
        "session_url": shared.session_url,
        "dir": pool.publish_dir(job_id),
    }
    return kept, {**files, "trainer.json": {**files["trainer.json"], "publish": publish}}


def _adapter_publishing_trainer(
    statefulset: dict[str, Any], job_id: str, pool_name: str, pool: ChartPool
) -> dict[str, Any]:
    """The trainer StatefulSet with the pool's adapter volume (its subdirectory `<job id>`), the pool as its
    publish pool and the session operator token; the weight-sync origin address goes (the job has no origin)."""
    trainer = copy.deepcopy(statefulset)
    pod = trainer["spec"]["template"]["spec"]
    claim = {"claimName": pool.adapter_claim_name}
    pod["volumes"] = [*pod.get("volumes", []), {"name": ADAPTER_VOLUME, "persistentVolumeClaim": claim}]
    containers = [c for c in pod["containers"] if c["name"] == TRAINER_CONTAINER]
    if not containers:
        raise FailedPreconditionError(f"the trainer template has no container {TRAINER_CONTAINER!r}")
    container = containers[0]
    token = {"secretKeyRef": {"name": pool.secret_name, "key": SESSION_TOKEN_KEY}}
    env = [e for e in container.get("env", []) if e["name"] not in (POOL_ENV, ORIGIN_ENV, SESSION_TOKEN_ENV)]
    container["env"] = [*env, {"name": POOL_ENV, "value": pool_name}, {"name": SESSION_TOKEN_ENV, "valueFrom": token}]
    mount = {"name": ADAPTER_VOLUME, "mountPath": pool.publish_dir(job_id), "subPath": job_id}
    container["volumeMounts"] = [*container.get("volumeMounts", []), mount]
    return trainer


def ready_engines(apps: k8s.AppsV1Api, namespace: str, templates: Mapping[str, str], name: str) -> int:
    """Ready engines of the shared pool `name` (0 while its Deployment is missing). Blocking: run it in a thread."""
    pool = chart_pool(templates, name)
    if pool is None:
        return 0
    try:
        deployment = apps.read_namespaced_deployment(pool.deployment, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return 0
        raise
    return int((deployment.status and deployment.status.ready_replicas) or 0)


def _component(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("labels", {}).get(COMPONENT_LABEL, ""))
