"""The per-job engine HPA on the Kubernetes backend, against the fake Kubernetes API (controller_kubernetes_testkit)
with the chart's templates rendered with `jobTemplates.engine.autoscaling.enabled`: the HPA is created with the job
(owned by its spec ConfigMap, valid against Kubernetes' schemas), and a resize moves its bounds with the Deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from controller_kubernetes_testkit import chart_job_templates, fake_cluster

from miles.common.jobspec.job import JobSpec

pytestmark = pytest.mark.integration  # runs helm

COMPONENT = "app.kubernetes.io/component"
AUTOSCALING_ON = ["jobTemplates.engine.autoscaling.enabled=true", "jobTemplates.engine.autoscaling.maxReplicas=6"]


@pytest.fixture(scope="module")
def autoscaled_templates(request: pytest.FixtureRequest) -> dict[str, str]:
    return chart_job_templates(Path(request.config.rootpath), set_values=AUTOSCALING_ON)


def _spec(controller_kit: Any) -> JobSpec:
    body = controller_kit.job_spec_body(num_steps=3)
    body["resources"] = {
        "engines": {"replicas": 2, "kind": "sglang", "gpus_per_replica": 1},
        "rollout_workers": {"replicas": 1},
        "trainer": {"replicas": 1, "gpus_per_replica": 1},
    }
    return JobSpec.model_validate(body)


def _engine_hpa(api: Any, job_id: str) -> dict[str, Any]:
    (hpa,) = [
        obj
        for obj in api.of_job(job_id)
        if obj["kind"] == "HorizontalPodAutoscaler" and obj["metadata"]["labels"][COMPONENT] == "engine"
    ]
    return dict(hpa)


async def test_engine_hpa_is_created_with_the_job_and_resize_moves_its_bounds(
    autoscaled_templates: dict[str, str], controller_kit: Any
) -> None:
    async with fake_cluster(autoscaled_templates) as (api, _, backend):
        spec = _spec(controller_kit)
        await backend.start("jhpa0000001", spec)
        hpa = _engine_hpa(api, "jhpa0000001")
        (owner,) = [obj for obj in api.of_job("jhpa0000001") if obj["metadata"]["name"].endswith("-spec")]
        assert [ref["uid"] for ref in hpa["metadata"]["ownerReferences"]] == [owner["metadata"]["uid"]]
        assert hpa["spec"]["scaleTargetRef"]["name"] == hpa["metadata"]["name"]  # the engine Deployment
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
        assert hpa["spec"]["metrics"][0]["external"]["metric"]["selector"] == {"matchLabels": {"pool": "jhpa0000001"}}

        await backend.resize("jhpa0000001", spec, engines=4, rollout_workers=None)
        hpa = _engine_hpa(api, "jhpa0000001")
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (4, 6)
        assert (await backend.observe("jhpa0000001", spec)).pools["engines"] == 4

        await backend.resize("jhpa0000001", spec, engines=8, rollout_workers=None)  # above the chart's maximum
        hpa = _engine_hpa(api, "jhpa0000001")
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (8, 8)

        await backend.stop("jhpa0000001")
        assert api.of_job("jhpa0000001") == []


async def test_a_job_asking_for_more_engines_than_the_maximum_gets_an_hpa_fixed_at_its_size(
    autoscaled_templates: dict[str, str], controller_kit: Any
) -> None:
    body = _spec(controller_kit).model_dump(mode="json")
    body["resources"]["engines"]["replicas"] = 10
    async with fake_cluster(autoscaled_templates) as (api, _, backend):
        await backend.start("jhpa0000002", JobSpec.model_validate(body))
        hpa = _engine_hpa(api, "jhpa0000002")
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (10, 10)


@pytest.fixture(scope="module")
def worker_autoscaled_templates(request: pytest.FixtureRequest) -> dict[str, str]:
    return chart_job_templates(
        Path(request.config.rootpath), set_values=["jobTemplates.rolloutWorker.autoscaling.enabled=true"]
    )


def _worker_hpa(api: Any, job_id: str) -> dict[str, Any]:
    (hpa,) = [
        obj
        for obj in api.of_job(job_id)
        if obj["kind"] == "HorizontalPodAutoscaler" and obj["metadata"]["labels"][COMPONENT] == "rollout-worker"
    ]
    return dict(hpa)


async def test_rollout_worker_hpa_spans_the_jobs_replicas_to_its_max_replicas(
    worker_autoscaled_templates: dict[str, str], controller_kit: Any
) -> None:
    """resources.rollout_workers.max_replicas is the worker HPA's maximum (null: the replicas, no room)."""
    body = _spec(controller_kit).model_dump(mode="json")
    body["resources"]["rollout_workers"] = {"replicas": 2, "max_replicas": 5}
    async with fake_cluster(worker_autoscaled_templates) as (api, _, backend):
        await backend.start("jhpa0000003", JobSpec.model_validate(body))
        assert (
            _worker_hpa(api, "jhpa0000003")["spec"]["minReplicas"],
            _worker_hpa(api, "jhpa0000003")["spec"]["maxReplicas"],
        ) == (2, 5)
        body["resources"]["rollout_workers"] = {"replicas": 2}
        await backend.start("jhpa0000004", JobSpec.model_validate(body))
        hpa = _worker_hpa(api, "jhpa0000004")
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 2)


def test_max_replicas_below_the_replicas_is_refused(controller_kit: Any) -> None:
    body = _spec(controller_kit).model_dump(mode="json")
    body["resources"]["rollout_workers"] = {"replicas": 3, "max_replicas": 2}
    with pytest.raises(ValueError, match=r"max_replicas \(2\) must be at least replicas \(3\)"):
        JobSpec.model_validate(body)
