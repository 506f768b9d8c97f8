"""Kueue admission of a job on Kubernetes (`spec.kueue`, on a release installed with `kueue.enabled`).

The controller is the job's Kueue integration, as Kueue's jobframework is for a batch Job: it creates one Workload
(`kueue.x-k8s.io/v1beta2`, Kueue's storage version since v0.15) per job, with one podSet per Deployment or
StatefulSet of the job (engines, rollout workers, trainer, weight-sync origin, environment server: count and pod
template as rendered), `spec.queueName` and the `kueue.x-k8s.io/queue-name` label, owned by the job's spec
ConfigMap (deleting the job deletes it). Kueue admits the Workload as one unit, so the job runs all of its pools or
none of them.

The job's Deployments and StatefulSets are created suspended: replicas 0, the count Kueue admits in the annotation
ADMITTED_REPLICAS_ANNOTATION and the queue in the label QUEUE_LABEL. They deliberately do not carry Kueue's own
queue-name label: Kueue's `deployment` / `statefulset` integrations (on by default) would then queue every pod on
its own, beside the Workload. `observe` (`reconcile`) follows the Workload:

- not admitted yet: phase `queued` (the job is QUEUED), with the QuotaReserved condition's message;
- admitted (condition Admitted): every suspended workload scaled to its admitted count at once, then the usual
  observation; when all pods are ready, the PodsReady condition (Kueue's waitForPodsReady);
- evicted (condition Evicted: preemption, a deactivated Workload, a PodsReady timeout): trainer rank 0 writes a
  durable checkpoint (gRPC `Checkpoint`: it acks the groups the checkpoint covers), every workload is scaled to 0,
  then the quota reservation is released (status.admission cleared, QuotaReserved False, Requeued True after a
  preemption), as Kueue's jobframework does; the job is QUEUED with the eviction's reason until Kueue readmits it,
  and then resumes from its checkpoint. The buffer is shared and is not touched: it keeps its groups, and groups
  leased by the trainer but not covered by the checkpoint return to it when their leases expire.

Limits: no priority class (a Workload priority needs the class's value, which the controller does not read); the
flavors Kueue assigns are not applied to the pod templates (no nodeSelector injection: use the job's node pools
for placement, and a ClusterQueue whose flavors match them); a job whose objects include a DaemonSet (weight-sync
`daemonset` mode) or a LeaderWorkerSet cannot be suspended by replicas and is refused; resizing a Kueue job is
refused (its podSets are what was admitted); rollout workers autoscaled by the chart's HPA count in Kueue's quota
with their admitted (starting) count only; a failed checkpoint does not delay the eviction (the trainer resumes
from its previous checkpoint and retrains the groups after it).
"""

from __future__ import annotations

import copy
import datetime
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from miles.common.errors import InvalidArgumentError
from miles.common.jobspec.job import JobSpec
from miles.controller.backends.base import JobProgress

log = logging.getLogger(__name__)

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
WORKLOAD_PLURAL = "workloads"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Kueue's queue label: on the Workload only (see the module docstring)."""
QUEUE_LABEL = "miles.dev/kueue-queue-name"
"""The queue of a Kueue job, on every one of its per-job objects."""
ADMITTED_REPLICAS_ANNOTATION = "miles.dev/kueue-replicas"
"""On a suspended Deployment / StatefulSet: the replicas it runs with once Kueue admits the job."""
JOB_LABEL = "miles.dev/job"
COMPONENT_LABEL = "app.kubernetes.io/component"
_SCALABLE_KINDS = frozenset({"Deployment", "StatefulSet"})
_UNSUSPENDABLE_KINDS = frozenset({"DaemonSet", "LeaderWorkerSet"})

CheckpointFn = Callable[[], Awaitable[str]]
"""Asks trainer rank 0 for a durable checkpoint; returns what happened, for the log."""


def check_kueue(spec: JobSpec, kueue_enabled: bool) -> None:
    """InvalidArgumentError (field `kueue`) for a Kueue job on a release installed without Kueue."""
    if spec.kueue is not None and not kueue_enabled:
        raise InvalidArgumentError(
            f"kueue.queue_name={spec.kueue.queue_name!r} asks for admission by Kueue, but this release is installed "
            "without it (the chart's kueue.enabled, controller setting kubernetes_kueue): drop the kueue block, or "
            "install the chart with kueue.enabled=true on a cluster running Kueue",
            field="kueue.queue_name",
        )


def unsuspendable_problem(objects: list[dict[str, Any]]) -> str:
    """Why the job's objects cannot be held by Kueue ("" when they can): a kind not scaled by replicas."""
    kinds = sorted({obj["kind"] for obj in objects} & _UNSUSPENDABLE_KINDS)
    if not kinds:
        return ""
    return (
        f"a Kueue job's pods are suspended by scaling its workloads to 0 replicas, and this job has {kinds} "
        "(weight-sync daemonset mode, multi-node engines), which are not scaled that way: drop the kueue block"
    )


def suspended(objects: list[dict[str, Any]], queue_name: str) -> list[dict[str, Any]]:
    """Copies of `objects`, every one labelled with the queue; Deployments and StatefulSets at 0 replicas with
    their rendered count in ADMITTED_REPLICAS_ANNOTATION."""
    held = []
    for obj in objects:
        copied = copy.deepcopy(obj)
        metadata = copied["metadata"]
        metadata["labels"] = {**metadata.get("labels", {}), QUEUE_LABEL: queue_name}
        if copied["kind"] in _SCALABLE_KINDS:
            replicas = int(copied["spec"].get("replicas", 1))
            metadata["annotations"] = {**metadata.get("annotations", {}), ADMITTED_REPLICAS_ANNOTATION: str(replicas)}
            copied["spec"]["replicas"] = 0
        held.append(copied)
    return held


def workload_name(spec_config_map_name: str) -> str:
    """The job's Workload: named after its spec ConfigMap (`<fullname>-<job>-spec` -> `<fullname>-<job>-kueue`)."""
    return f"{spec_config_map_name.removesuffix('-spec')}-kueue"


def workload_of(name: str, job_id: str, queue_name: str, held: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's Workload: a podSet per suspended Deployment / StatefulSet (named by its component label)."""
    pod_sets = []
    for obj in held:
        annotations = obj["metadata"].get("annotations", {})
        if obj["kind"] in _SCALABLE_KINDS and ADMITTED_REPLICAS_ANNOTATION in annotations:
            pod_sets.append(
                {
                    "name": obj["metadata"]["labels"].get(COMPONENT_LABEL) or obj["metadata"]["name"],
                    "count": int(annotations[ADMITTED_REPLICAS_ANNOTATION]),
                    "template": obj["spec"]["template"],
                }
            )
    return {
        "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
        "kind": "Workload",
        "metadata": {
            "name": name,
            "labels": {JOB_LABEL: job_id, COMPONENT_LABEL: "kueue-workload", KUEUE_QUEUE_LABEL: queue_name},
        },
        "spec": {"queueName": queue_name, "podSets": pod_sets},
    }


def condition(workload: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    """The Workload's status condition of type `kind`, or None."""
    conditions = workload.get("status", {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), None)


def is_true(workload: Mapping[str, Any], kind: str) -> bool:
    found = condition(workload, kind)
    return found is not None and found.get("status") == "True"


def _with_condition(conditions: list[dict[str, Any]], kind: str, status: str, reason: str, message: str) -> None:
    """Set one condition in place (lastTransitionTime changes only when the status does), like apimeta does."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    new = {"type": kind, "status": status, "reason": reason, "message": message[:32768], "lastTransitionTime": now}
    for index, existing in enumerate(conditions):
        if existing.get("type") == kind:
            if existing.get("status") == status:
                new["lastTransitionTime"] = existing.get("lastTransitionTime", now)
            conditions[index] = {**existing, **new}
            return
    conditions.append(new)


def released(workload: Mapping[str, Any], message: str) -> dict[str, Any]:
    """The status patch that gives an evicted Workload's quota back (Kueue's UnsetQuotaReservationWithCondition:
    admission cleared, QuotaReserved and Admitted False; Requeued True after a preemption), conditional on the
    Workload's resourceVersion (a concurrent change by Kueue makes it a 409, retried at the next observation)."""
    conditions = copy.deepcopy(workload.get("status", {}).get("conditions") or [])
    _with_condition(conditions, "QuotaReserved", "False", "Pending", message)
    _with_condition(conditions, "Admitted", "False", "NoReservation", "The workload has no reservation")
    evicted = condition(workload, "Evicted") or {}
    requeued = "True" if evicted.get("reason") in ("Preempted", "NodeFailures") else "False"
    _with_condition(conditions, "Requeued", requeued, str(evicted.get("reason") or "Pending"), message)
    if condition(workload, "PodsReady") is not None:  # the pods are gone; they start again after readmission
        _with_condition(conditions, "PodsReady", "False", "WaitForStart", "Not all pods are ready or succeeded")
    return _versioned(workload, {"admission": None, "conditions": conditions})


def pods_ready(workload: Mapping[str, Any]) -> dict[str, Any]:
    """The status patch that says every admitted pod is ready (Kueue's PodsReady condition)."""
    conditions = copy.deepcopy(workload.get("status", {}).get("conditions") or [])
    _with_condition(
        conditions, "PodsReady", "True", "Started", "All pods reached readiness and the workload is running"
    )
    return _versioned(workload, {"conditions": conditions})


def _versioned(workload: Mapping[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """A status patch that applies only to the Workload as read (its resourceVersion: a 409 otherwise)."""
    version = workload.get("metadata", {}).get("resourceVersion")
    return {"metadata": {"resourceVersion": version}, "status": status} if version else {"status": status}


def queued_reason(workload: Mapping[str, Any]) -> str:
    """What the job is waiting for, in Kueue's words."""
    queue = workload.get("spec", {}).get("queueName", "?")
    evicted = condition(workload, "Evicted")
    if evicted is not None and evicted.get("status") == "True":
        return f"evicted by Kueue ({evicted.get('reason')}): {evicted.get('message', '')}; waiting for readmission"
    reserved = condition(workload, "QuotaReserved") or condition(workload, "Admitted")
    detail = f": {reserved.get('message')}" if reserved is not None and reserved.get("message") else ""
    return f"waiting for admission by Kueue queue {queue!r}{detail}"


@dataclass(frozen=True)
class HeldWorkload:
    """One suspended Deployment / StatefulSet of a Kueue job, as last read."""

    kind: str
    name: str
    replicas: int
    admitted_replicas: int
    ready_replicas: int


class KueueAdmission:
    """Creates a job's Workload and follows it (`reconcile`, from `observe`)."""

    def __init__(self, api_client: k8s.ApiClient, namespace: str, call: Callable[..., Awaitable[Any]]) -> None:
        """`call` runs a blocking client call in a thread and maps its errors (the backend's `_call`)."""
        self.namespace = namespace
        self.custom = k8s.CustomObjectsApi(api_client)
        self.apps = k8s.AppsV1Api(api_client)
        self._call = call

    async def create(self, workload: dict[str, Any]) -> None:
        """Create the Workload; one that already exists (an adopted job) is kept as it is."""
        try:
            await self._call(
                self.custom.create_namespaced_custom_object,
                KUEUE_GROUP,
                KUEUE_VERSION,
                self.namespace,
                WORKLOAD_PLURAL,
                workload,
            )
        except ApiException as exc:
            if exc.status != 409:
                raise

    async def reconcile(self, job_id: str, name: str, checkpoint: CheckpointFn) -> JobProgress | None:
        """Act on the Workload's admission; a `queued` progress while the job may not run, None once it runs."""
        try:
            workload = await self._call(
                self.custom.get_namespaced_custom_object,
                KUEUE_GROUP,
                KUEUE_VERSION,
                self.namespace,
                WORKLOAD_PLURAL,
                name,
            )
        except ApiException as exc:
            if exc.status == 404:
                return JobProgress("failed", error=f"the job's Kueue Workload {name} was deleted")
            raise
        held = await self._held(job_id)
        if not is_true(workload, "Admitted") or is_true(workload, "Evicted"):
            reason = queued_reason(workload)
            if any(item.replicas > 0 for item in held):
                outcome = await checkpoint()
                log.info("suspending a Kueue job", extra={"job_id": job_id, "reason": reason, "checkpoint": outcome})
                await self._scale(held, admitted=False)
            if is_true(workload, "Evicted") and workload.get("status", {}).get("admission") is not None:
                await self._patch_status(name, released(workload, reason))
            return JobProgress("queued", error=reason)
        suspended_now = [item for item in held if item.replicas == 0 < item.admitted_replicas]
        if suspended_now:  # only those at 0: an autoscaled rollout-worker Deployment keeps its HPA's count
            await self._scale(suspended_now, admitted=True)
        elif (
            held
            and all(item.ready_replicas >= item.admitted_replicas for item in held)
            and not is_true(workload, "PodsReady")
        ):
            await self._patch_status(name, pods_ready(workload))
        return None

    async def _held(self, job_id: str) -> list[HeldWorkload]:
        selector = f"{JOB_LABEL}={job_id}"
        deployments = await self._call(self.apps.list_namespaced_deployment, self.namespace, label_selector=selector)
        statefulsets = await self._call(self.apps.list_namespaced_stateful_set, self.namespace, label_selector=selector)
        held = []
        for kind, items in (("Deployment", deployments.items), ("StatefulSet", statefulsets.items)):
            for item in items:
                admitted = (item.metadata.annotations or {}).get(ADMITTED_REPLICAS_ANNOTATION)
                if admitted is None:
                    continue
                ready = int((item.status and item.status.ready_replicas) or 0)
                held.append(HeldWorkload(kind, item.metadata.name, int(item.spec.replicas or 0), int(admitted), ready))
        return held

    async def _scale(self, held: list[HeldWorkload], *, admitted: bool) -> None:
        """Every held workload to its admitted count, or to 0 (all of them, one call each)."""
        for item in held:
            body = {"spec": {"replicas": item.admitted_replicas if admitted else 0}}
            if item.kind == "Deployment":
                await self._call(self.apps.patch_namespaced_deployment, item.name, self.namespace, body)
            else:
                await self._call(self.apps.patch_namespaced_stateful_set, item.name, self.namespace, body)

    async def _patch_status(self, name: str, body: dict[str, Any]) -> None:
        try:
            await self._call(
                self.custom.patch_namespaced_custom_object_status,
                KUEUE_GROUP,
                KUEUE_VERSION,
                self.namespace,
                WORKLOAD_PLURAL,
                name,
                body,
            )
        except ApiException as exc:
            if exc.status != 409:  # Kueue changed it meanwhile: decided again at the next observation
                raise
