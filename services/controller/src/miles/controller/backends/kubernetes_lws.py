"""Multi-node engine replicas on Kubernetes: one LeaderWorkerSet per job instead of the engine Deployment.

A job whose engine replica spans nodes (`resources.engines.nodes_per_replica` > 1: SGLang tensor parallelism over
several pods) gets the chart's engine LeaderWorkerSet (`job_templates.ENGINE_LWS_TEMPLATE_KEY`; the chart renders
it with `leaderWorkerSet.enabled`, which needs the LWS CRD and controller in the cluster): `replicas` groups of
`nodes_per_replica` pods, restarted as a group (`RecreateGroupOnPodRestart`). A job like that on a release without
the template is refused at submission (`lws_problem`, a 400 naming `resources.engines.nodes_per_replica`).

This module owns the LeaderWorkerSet's API calls (the official client's CustomObjectsApi: create, or read back an
adopted one; list the job's to read `status.readyReplicas`, the ready groups; merge-patch `spec.replicas` to
resize). The backend (`kubernetes.py`) decides when to call them. Deleting the job deletes its LeaderWorkerSet
through the ownerReference to the job's spec ConfigMap, like every other per-job object.

Limits: a group's readiness is LWS's (the leader pod ready, i.e. SGLang serving after every rank joined); a group
that keeps failing is not reported as a failed job (LWS has no progress deadline), the job stays STARTING. Only the
engines are LeaderWorkerSets; the trainer stays a StatefulSet (one pod per rank, restarted one by one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from miles.common.errors import FailedPreconditionError, UnavailableError
from miles.common.jobspec.job import JobSpec
from miles.controller.job_templates import ENGINE_LWS_TEMPLATE_KEY

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_PLURAL = "leaderworkersets"
LWS_KIND = "LeaderWorkerSet"
ENGINE_COMPONENT = "engine"
_COMPONENT_LABEL = "app.kubernetes.io/component"
_JOB_LABEL = "miles.dev/job"


def is_multi_node(spec: JobSpec) -> bool:
    """Whether the job's engines are LeaderWorkerSet groups (a replica spans more than one node)."""
    return spec.resources.engines.nodes_per_replica > 1


def lws_problem(spec: JobSpec, templates: Mapping[str, str]) -> tuple[str, str] | None:
    """(field, why) when `spec` has multi-node engines and this release's chart has no LeaderWorkerSet template."""
    if not is_multi_node(spec) or ENGINE_LWS_TEMPLATE_KEY in templates:
        return None
    nodes = spec.resources.engines.nodes_per_replica
    return "resources.engines.nodes_per_replica", (
        f"resources.engines.nodes_per_replica={nodes} runs each engine replica as a LeaderWorkerSet, which this "
        "release does not enable: install LeaderWorkerSet (kubernetes-sigs/lws) in the cluster and the chart with "
        "leaderWorkerSet.enabled=true, or use nodes_per_replica 1 (tp_size at most gpus_per_replica)"
    )


def _creation_error(obj: Mapping[str, Any], exc: ApiException) -> Exception:
    message = f"creating {obj['kind']} {obj['metadata']['name']} failed: {exc.status} {exc.reason}: {exc.body}"
    if exc.status == 404:  # the API server does not serve the kind: the CRD is not installed
        message += " (is LeaderWorkerSet installed in the cluster? kubernetes-sigs/lws)"
    retryable = exc.status is None or exc.status >= 500 or exc.status == 429
    return (UnavailableError if retryable else FailedPreconditionError)(message)


def create_or_read(api_client: k8s.ApiClient, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    """Create the LeaderWorkerSet `obj`; when it already exists (an adopted job), read it back. Blocking: run it
    in a worker thread. Returns the object as stored; raises UnavailableError / FailedPreconditionError."""
    custom = k8s.CustomObjectsApi(api_client)
    try:
        created = custom.create_namespaced_custom_object(LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, obj)
    except ApiException as exc:
        if exc.status != 409:
            raise _creation_error(obj, exc) from None
        name = obj["metadata"]["name"]
        created = custom.get_namespaced_custom_object(LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name)
    return cast("dict[str, Any]", created)


def ready_engine_groups(api_client: k8s.ApiClient, namespace: str, job_id: str) -> int:
    """Ready groups (SGLang servers) of the job's engine LeaderWorkerSet; 0 while it has none. Blocking."""
    custom = k8s.CustomObjectsApi(api_client)
    selector = f"{_JOB_LABEL}={job_id},{_COMPONENT_LABEL}={ENGINE_COMPONENT}"
    listed = cast(
        "dict[str, Any]",
        custom.list_namespaced_custom_object(LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, label_selector=selector),
    )
    return sum(int((item.get("status") or {}).get("readyReplicas") or 0) for item in listed.get("items", []))


def resize(api_client: k8s.ApiClient, namespace: str, name: str, replicas: int) -> None:
    """Set the LeaderWorkerSet `name`'s groups to `replicas` (a JSON merge patch of spec.replicas). Blocking."""
    k8s.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        LWS_GROUP,
        LWS_VERSION,
        namespace,
        LWS_PLURAL,
        name,
        {"spec": {"replicas": replicas}},
        _content_type="application/merge-patch+json",
    )
