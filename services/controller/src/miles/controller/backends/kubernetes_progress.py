"""What `KubernetesJobBackend.observe` makes of a job's workloads and of trainer rank 0's Status.

`ready_pools` reads the ready replicas of the job's Deployments and StatefulSet (label `miles.dev/job=<id>`) per
pool, and the reason a workload gave up (its progress deadline exceeded). `job_progress` turns those and trainer
rank 0's gRPC `Status` into the job's phase: the trainer's FINISHED / FAILED decide; a workload that gave up fails
the job; else RUNNING once the trainer is past STARTING or every pool has its replicas, and the job's inference
pools (judge, teacher) have their engines.

Limits: readiness is Kubernetes' (`status.readyReplicas`); the environment server is not a pool and is not waited
for (its rollout workers wait for it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes import client as k8s

from miles.common.jobspec.job import JobSpec
from miles.controller.backends import kubernetes_inference_pools
from miles.controller.backends.base import JobProgress
from miles.proto.trainer.v1 import trainer_pb2

_COMPONENT_LABEL = "app.kubernetes.io/component"
_JOB_LABEL = "miles.dev/job"
POOL_COMPONENTS = {"engines": "engine", "rollout_workers": "rollout-worker", "trainer": "trainer"}
"""Pool name (JobProgress.pools) -> the component label of its workload."""


async def ready_pools(
    call: Callable[..., Awaitable[Any]], apps: k8s.AppsV1Api, namespace: str, job_id: str
) -> tuple[dict[str, int], str]:
    """Ready replicas per pool, and a reason when a workload gave up (progress deadline exceeded). `call` runs a
    blocking client call in a thread and maps its errors (the backend's `_call`)."""
    selector = f"{_JOB_LABEL}={job_id}"
    deployments = await call(apps.list_namespaced_deployment, namespace, label_selector=selector)
    statefulsets = await call(apps.list_namespaced_stateful_set, namespace, label_selector=selector)
    ready: dict[str, int] = {}
    problem = ""
    for workload in [*deployments.items, *statefulsets.items]:
        labels = workload.metadata.labels or {}
        component = labels.get(_COMPONENT_LABEL, "")
        ready[component] = int((workload.status and workload.status.ready_replicas) or 0)
        for condition in (workload.status and workload.status.conditions) or []:
            if condition.reason == "ProgressDeadlineExceeded":
                problem = f"{workload.metadata.name}: {condition.message or condition.reason}"
    return {pool: ready.get(component, 0) for pool, component in POOL_COMPONENTS.items()}, problem


def job_progress(
    spec: JobSpec, pools: dict[str, int], problem: str, status: trainer_pb2.StatusResponse | None
) -> JobProgress:
    """The job's progress from its pools' ready replicas (`pools`, with `inference_engines` for a job with
    inference pools), a workload's reason for giving up (`problem`, "" when none) and trainer rank 0's Status
    (None while it cannot be reached)."""
    metrics: dict[str, float] = {}
    step = weight_version = 0
    finished_ms = int(status.last_step_finished_unix_ms) if status is not None else 0
    if status is not None:
        step, weight_version = int(status.step), int(status.weight_version)
        metrics = {key: float(value) for key, value in status.last_step_metrics.items()}
        if status.state == trainer_pb2.TRAINER_STATE_FINISHED:
            return JobProgress(
                "succeeded", step, weight_version, pools=pools, metrics=metrics, step_finished_unix_ms=finished_ms
            )
        if status.state == trainer_pb2.TRAINER_STATE_FAILED:
            error = f"trainer failed: {status.error}"
            return JobProgress(
                "failed",
                step,
                weight_version,
                error,
                pools=pools,
                metrics=metrics,
                step_finished_unix_ms=finished_ms,
            )
    if problem:
        return JobProgress(
            "failed", step, weight_version, problem, pools=pools, metrics=metrics, step_finished_unix_ms=finished_ms
        )
    desired = {
        "engines": 0 if spec.resources.engines.shared_pool is not None else spec.resources.engines.replicas,
        "rollout_workers": spec.resources.rollout_workers.replicas,
        "trainer": spec.resources.trainer.replicas,
    }
    trainer_up = status is not None and status.state != trainer_pb2.TRAINER_STATE_STARTING
    all_ready = all(pools.get(pool, 0) >= size for pool, size in desired.items())
    inference_up = pools.get("inference_engines", 0) >= kubernetes_inference_pools.num_inference_engines(spec)
    phase = "running" if (trainer_up or all_ready) and inference_up else "starting"
    return JobProgress(phase, step, weight_version, pools=pools, metrics=metrics, step_finished_unix_ms=finished_ms)  # type: ignore[arg-type]
