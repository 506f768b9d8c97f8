"""Kueue admission of a job (`spec.kueue`): the Kubernetes backend against the fake API (controller_kubernetes_testkit)
with the chart's own templates, Kueue played by the tests (admission, preemption and readmission written into the
Workload's status as Kueue v0.19 writes them), and the supervisor's QUEUED state with the in-memory backend.

What a fake cluster cannot show: pods really stopping and starting, the trainer really resuming from its checkpoint,
and the buffer's groups surviving; here the checks are on what the controller does (checkpoint asked while the pods
still run, every pool scaled to 0 and back, the same objects kept, the buffer never called).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from controller_kubernetes_testkit import NAMESPACE, chart_job_templates, fake_cluster

from miles.common.errors import FailedPreconditionError, InvalidArgumentError
from miles.common.jobspec.job import JobSpec
from miles.common.testing.crd_schemas import validate_custom_object
from miles.controller.backends.base import JobProgress
from miles.controller.backends.kubernetes_kueue import (
    ADMITTED_REPLICAS_ANNOTATION,
    KUEUE_QUEUE_LABEL,
    QUEUE_LABEL,
    check_kueue,
    is_true,
)

pytestmark = pytest.mark.integration
JOB_ID = "jkueue000001"
WORKLOAD_KEY = ("apis/kueue.x-k8s.io/v1beta2", "workloads", NAMESPACE, f"miles-{JOB_ID}-kueue")


@pytest.fixture(scope="module")
def job_templates(request: pytest.FixtureRequest) -> dict[str, str]:
    return chart_job_templates(Path(request.config.rootpath))


def _spec(controller_kit: Any, queue_name: str = "team-a") -> JobSpec:
    body = controller_kit.job_spec_body(num_steps=3)
    body["resources"] = {
        "engines": {"replicas": 2, "kind": "sglang", "gpus_per_replica": 1},
        "rollout_workers": {"replicas": 2},
        "trainer": {"replicas": 1, "gpus_per_replica": 1},
    }
    body["kueue"] = {"queue_name": queue_name}
    return JobSpec.model_validate(body)


def _set_condition(workload: dict[str, Any], kind: str, status: str, reason: str, message: str) -> None:
    conditions = workload.setdefault("status", {}).setdefault("conditions", [])
    new = {"type": kind, "status": status, "reason": reason, "message": message}
    new["lastTransitionTime"] = "2026-01-01T00:00:00Z"
    conditions[:] = [c for c in conditions if c["type"] != kind] + [new]


def _admit(api: Any) -> None:
    """What Kueue's scheduler writes when it admits the Workload (SetQuotaReservation, then Admitted)."""
    workload = api.objects[WORKLOAD_KEY]
    assignments = [
        {"name": pod_set["name"], "count": pod_set["count"], "flavors": {"cpu": "default-flavor"}}
        for pod_set in workload["spec"]["podSets"]
    ]
    workload.setdefault("status", {})["admission"] = {"clusterQueue": "cluster-queue", "podSetAssignments": assignments}
    _set_condition(workload, "QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cluster-queue")
    _set_condition(workload, "Admitted", "True", "Admitted", "The workload is admitted")
    for kind in ("Evicted", "Preempted"):
        if is_true(workload, kind):
            _set_condition(workload, kind, "False", "QuotaReserved", "Previously: preempted")
    workload["metadata"]["resourceVersion"] = uuid.uuid4().hex
    validate_custom_object(workload)


def _preempt(api: Any) -> None:
    """What Kueue's preemptor writes on a Workload it preempts (Evicted and Preempted; quota still reserved)."""
    workload = api.objects[WORKLOAD_KEY]
    message = "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue"
    _set_condition(workload, "Evicted", "True", "Preempted", message)
    _set_condition(workload, "Preempted", "True", "InClusterQueue", message)
    workload["metadata"]["resourceVersion"] = uuid.uuid4().hex
    validate_custom_object(workload)


def _held(api: Any) -> dict[str, int]:
    """Replicas of the job's Deployments and StatefulSets by name."""
    return {
        obj["metadata"]["name"]: obj["spec"]["replicas"]
        for obj in api.of_job(JOB_ID)
        if obj["kind"] in ("Deployment", "StatefulSet")
    }


def _uids(api: Any) -> set[str]:
    return {obj["metadata"]["uid"] for obj in api.of_job(JOB_ID)}


async def _admitted_and_running(api: Any, backend: Any, spec: JobSpec) -> JobProgress:
    _admit(api)
    await backend.observe(JOB_ID, spec)  # scales every pool up
    return await backend.observe(JOB_ID, spec)


async def test_kueue_job_is_created_suspended_with_the_queue_label_and_a_valid_workload(
    job_templates: dict[str, str], controller_kit: Any
) -> None:
    async with fake_cluster(job_templates) as (api, _, backend):
        backend.kueue_enabled = True
        spec = _spec(controller_kit)
        await backend.check_spec(spec)
        await backend.start(JOB_ID, spec)
        objects = api.of_job(JOB_ID)
        held = [obj for obj in objects if obj["kind"] in ("Deployment", "StatefulSet")]
        assert {obj["metadata"]["labels"]["app.kubernetes.io/component"] for obj in held} >= {
            "engine",
            "rollout-worker",
            "trainer",
        }
        assert all(obj["spec"]["replicas"] == 0 for obj in held)
        spec_config_map = next(obj for obj in objects if obj["kind"] == "ConfigMap")
        rendered = [obj for obj in objects if obj["kind"] not in ("ConfigMap", "Secret", "Workload")]
        assert all(obj["metadata"]["labels"][QUEUE_LABEL] == "team-a" for obj in rendered)
        assert not any(KUEUE_QUEUE_LABEL in obj["metadata"]["labels"] for obj in objects if obj["kind"] != "Workload")
        workload = api.objects[WORKLOAD_KEY]
        validate_custom_object(workload)  # the fake validated it on create too
        assert workload["spec"]["queueName"] == "team-a"
        assert workload["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-a"
        counts = {pod_set["name"]: pod_set["count"] for pod_set in workload["spec"]["podSets"]}
        admitted = {obj["metadata"]["labels"]["app.kubernetes.io/component"]: obj for obj in held}
        assert counts == {
            component: int(obj["metadata"]["annotations"][ADMITTED_REPLICAS_ANNOTATION])
            for component, obj in admitted.items()
        }
        assert counts["engine"] == 2 and counts["rollout-worker"] == 2 and counts["trainer"] == 1
        (owner,) = workload["metadata"]["ownerReferences"]
        assert owner["uid"] == spec_config_map["metadata"]["uid"]
        progress = await backend.observe(JOB_ID, spec)
        assert progress.phase == "queued" and "team-a" in progress.error
        assert all(replicas == 0 for replicas in _held(api).values())
        await backend.start(JOB_ID, spec)  # a restarted controller adopts the job: still suspended
        assert all(replicas == 0 for replicas in _held(api).values())
        await backend.stop(JOB_ID)
        assert WORKLOAD_KEY not in api.objects  # owned by the spec ConfigMap: garbage-collected with the job


async def test_admission_scales_every_pool_up_at_once_and_the_job_runs(
    job_templates: dict[str, str], controller_kit: Any
) -> None:
    async with fake_cluster(job_templates) as (api, trainer, backend):
        backend.kueue_enabled = True
        spec = _spec(controller_kit)
        await backend.start(JOB_ID, spec)
        assert (await backend.observe(JOB_ID, spec)).phase == "queued"
        _admit(api)
        await backend.observe(JOB_ID, spec)
        assert _held(api) == {
            f"miles-{JOB_ID}-engine": 2,
            f"miles-{JOB_ID}-rollout-worker": 2,
            f"miles-{JOB_ID}-trainer": 1,
            f"miles-{JOB_ID}-weight-sync-origin": 1,
        }
        progress = await backend.observe(JOB_ID, spec)
        assert progress.phase == "running" and progress.pools["engines"] == 2
        assert is_true(api.objects[WORKLOAD_KEY], "PodsReady")  # Kueue's waitForPodsReady sees the pods up
        validate_custom_object(api.objects[WORKLOAD_KEY])
        assert trainer.checkpoints == 0


async def test_preemption_checkpoints_then_suspends_and_readmission_resumes_the_same_objects(
    job_templates: dict[str, str], controller_kit: Any
) -> None:
    async with fake_cluster(job_templates) as (api, trainer, backend):
        backend.kueue_enabled = True
        spec = _spec(controller_kit)
        await backend.start(JOB_ID, spec)
        assert (await _admitted_and_running(api, backend, spec)).phase == "running"
        uids, running = _uids(api), _held(api)
        at_checkpoint: list[dict[str, int]] = []
        trainer.on_checkpoint = lambda: at_checkpoint.append(_held(api))
        _preempt(api)
        progress = await backend.observe(JOB_ID, spec)
        assert progress.phase == "queued" and "Preempted" in progress.error
        assert at_checkpoint == [running]  # the checkpoint was asked while every pod still ran
        assert all(replicas == 0 for replicas in _held(api).values())
        workload = api.objects[WORKLOAD_KEY]
        assert "admission" not in workload["status"]  # the quota is given back, so Kueue can requeue it
        assert not is_true(workload, "QuotaReserved") and not is_true(workload, "Admitted")
        assert is_true(workload, "Requeued") and is_true(workload, "Evicted") and not is_true(workload, "PodsReady")
        validate_custom_object(workload)
        assert (await backend.observe(JOB_ID, spec)).phase == "queued"
        assert trainer.checkpoints == 1  # once: the job is already suspended
        assert (await _admitted_and_running(api, backend, spec)).phase == "running"
        assert _held(api) == running and _uids(api) == uids  # the same objects, scaled back
        assert is_true(api.objects[WORKLOAD_KEY], "PodsReady")
        # The buffer is a shared service the backend never calls: its groups are untouched by the preemption.
        assert all("buffer" not in path for _, path in api.requests)


async def test_kueue_job_is_refused_on_a_release_without_kueue(
    job_templates: dict[str, str], controller_kit: Any
) -> None:
    spec = _spec(controller_kit)
    with pytest.raises(InvalidArgumentError) as refused:
        check_kueue(spec, kueue_enabled=False)
    assert refused.value.field == "kueue.queue_name" and "kueue.enabled" in refused.value.message
    async with fake_cluster(job_templates) as (api, _, backend):
        with pytest.raises(InvalidArgumentError):
            await backend.check_spec(spec)
        with pytest.raises(FailedPreconditionError):
            await backend.start(JOB_ID, spec)
        assert WORKLOAD_KEY not in api.objects


async def test_kueue_job_is_refused_by_the_local_backend(controller_kit: Any) -> None:
    from miles.controller.backends.local_layout import unsupported

    spec = _spec(controller_kit)
    shared = controller_kit.make_settings("redis://unused:6379/0").shared_services()
    problem = unsupported(spec, shared)
    assert problem is not None and problem[0] == "kueue"


class _QueuedBackend:
    """The in-memory backend with a job that starts queued (Kueue has not admitted it yet)."""

    def __new__(cls, controller_kit: Any) -> Any:
        backend = controller_kit.FakeBackend(auto_step=False)
        start = backend.start

        async def start_queued(job_id: str, spec: JobSpec, *, record_routing: bool | None = None) -> None:
            await start(job_id, spec, record_routing=record_routing)
            if backend.jobs[job_id].starts == 1:
                backend.jobs[job_id].phase = "queued"
                backend.jobs[job_id].error = "waiting for admission by Kueue queue 'team-a'"

        backend.start = start_queued
        return backend


async def test_job_is_queued_until_admitted_and_back_to_queued_when_preempted(
    redis_url: str, controller_kit: Any
) -> None:
    kit = controller_kit
    backend = _QueuedBackend(kit)
    async with kit.running(kit.make_settings(redis_url), backend) as client:
        body = kit.job_spec_body(num_steps=5, kueue={"queue_name": "team-a"})
        job_id = (await client.post("/v1/jobs", json=body)).json()["job_id"]
        await kit.wait_for_state(client, job_id, "QUEUED")
        resized = await client.patch(f"/v1/jobs/{job_id}", json={"engines": 3})
        assert resized.status_code == 400 and "Kueue" in resized.text
        backend.jobs[job_id].phase = "running"
        await kit.wait_for_state(client, job_id, "RUNNING")
        backend.jobs[job_id].phase = "queued"
        backend.jobs[job_id].error = "evicted by Kueue (Preempted): to accommodate a workload"
        queued = await kit.wait_for_state(client, job_id, "QUEUED")
        assert any("suspended: evicted by Kueue (Preempted)" in error for error in queued["errors"])
        backend.jobs[job_id].phase = "running"
        await kit.wait_for_state(client, job_id, "RUNNING")
        await client.post(f"/v1/jobs/{job_id}/cancel")
        states = [event for event in await _events(client, job_id) if "state" in event]
    assert [event["state"] for event in states] == ["PENDING", "QUEUED", "RUNNING", "QUEUED", "RUNNING", "CANCELLED"]
    assert states[1]["reason"].startswith("waiting for admission") and states[1]["previous"] == "PENDING"
    assert states[3]["reason"].startswith("evicted by Kueue (Preempted)") and states[3]["previous"] == "RUNNING"
    assert states[4]["previous"] == "QUEUED"


async def _events(client: Any, job_id: str) -> list[dict[str, Any]]:
    """Every event of the job's stream, read until the server ends it (the job ended)."""

    async def read() -> list[dict[str, Any]]:
        async with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            return [json.loads(line[6:]) async for line in response.aiter_lines() if line.startswith("data: ")]

    return await asyncio.wait_for(read(), timeout=60)


async def test_kueue_job_with_weight_sync_daemons_is_refused_before_anything_is_created(
    request: pytest.FixtureRequest, controller_kit: Any
) -> None:
    daemonset_mode = ["jobTemplates.weightSync.mode=daemonset", "networkPolicy.nodeCidrs[0]=10.0.0.0/16"]
    templates = chart_job_templates(Path(request.config.rootpath), set_values=daemonset_mode)
    async with fake_cluster(templates) as (api, _, backend):
        backend.kueue_enabled = True
        with pytest.raises(FailedPreconditionError, match="DaemonSet"):
            await backend.start(JOB_ID, _spec(controller_kit))
        assert api.of_job(JOB_ID) == []


def test_the_vendored_workload_schema_refuses_what_the_api_server_would() -> None:
    pod_set = {"name": "trainer", "count": 1, "template": {"spec": {"containers": [{"name": "t", "image": "i"}]}}}
    workload = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {"name": "w"},
        "spec": {"queueName": "team-a", "podSets": [pod_set]},
    }
    validate_custom_object(workload)
    with pytest.raises(ValueError, match=r"spec\.podSets\.0\.name"):
        validate_custom_object({**workload, "spec": {"podSets": [{**pod_set, "name": "Trainer_0"}]}})
    with pytest.raises(ValueError, match="spec"):
        validate_custom_object({**workload, "spec": {**workload["spec"], "suspend": True}})  # not a Workload field
