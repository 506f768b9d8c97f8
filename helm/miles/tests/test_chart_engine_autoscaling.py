"""The per-job engine HPA (`jobTemplates.engine.autoscaling`): off by default; on, the job's engine Deployment scales
from the job's replicas up to maxReplicas on the router's saturation ratio of the job's pool (an External metric),
slowly down; the controller fits its bounds and aims it at the engine LeaderWorkerSet of a multi-node job."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from miles.common.testing.helm import by_kind
from miles.controller.backends.kubernetes_autoscaling import fitted_autoscalers
from miles.controller.job_templates import JobTemplateParams

pytestmark = pytest.mark.integration  # runs helm

AUTOSCALING_ON = ("jobTemplates.engine.autoscaling.enabled=true",)
COMPONENT = "app.kubernetes.io/component"
Objects = Callable[..., list[dict[str, Any]]]


def _engine_hpas(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in by_kind(objects, "HorizontalPodAutoscaler") if o["metadata"]["labels"][COMPONENT] == "engine"]


@pytest.mark.parametrize("value_set", ["default", "ci", "gpu"])
def test_engine_autoscaling_is_off_by_default(templates_of: Callable[..., dict[str, str]], value_set: str) -> None:
    assert "engine-hpa.yaml" not in templates_of(value_set)


def test_engine_hpa_scales_the_jobs_engine_deployment_on_its_pools_saturation_ratio(
    job_objects: Objects, example_job: JobTemplateParams, validate: Callable[[dict[str, Any]], None]
) -> None:
    objects = job_objects("gpu", AUTOSCALING_ON)
    (hpa,) = _engine_hpas(objects)
    (engines,) = [o for o in by_kind(objects, "Deployment") if o["metadata"]["labels"][COMPONENT] == "engine"]

    validate(hpa)
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": engines["metadata"]["name"],
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (example_job.engine_replicas, 8)
    assert hpa["metadata"]["labels"]["miles.dev/job"] == example_job.job_id
    (metric,) = spec["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"] == {
        "name": "miles_router_pool_saturation_ratio",
        "selector": {"matchLabels": {"pool": example_job.job_id}},
    }
    assert metric["external"]["target"] == {"type": "Value", "value": "900m"}
    behavior = spec["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 120
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 120}]


def test_engine_hpa_values_set_its_bounds_metric_and_target(job_objects: Objects) -> None:
    values = (
        *AUTOSCALING_ON,
        "jobTemplates.engine.autoscaling.maxReplicas=16",
        "jobTemplates.engine.autoscaling.metricName=miles_engine_backlog",
        "jobTemplates.engine.autoscaling.targetValue=1.5",
    )
    (hpa,) = _engine_hpas(job_objects("default", values))
    (metric,) = hpa["spec"]["metrics"]

    assert hpa["spec"]["maxReplicas"] == 16
    assert metric["external"]["metric"]["name"] == "miles_engine_backlog"
    assert metric["external"]["target"]["value"] == "1.5"


def test_controller_raises_max_replicas_to_a_job_asking_for_more_engines(
    job_objects: Objects, example_job: JobTemplateParams, validate: Callable[[dict[str, Any]], None]
) -> None:
    big_job = dataclasses.replace(example_job, engine_replicas=12)
    (hpa,) = _engine_hpas(fitted_autoscalers(job_objects("gpu", AUTOSCALING_ON, big_job)))

    validate(hpa)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (12, 12)


def test_multi_node_engines_autoscale_their_leaderworkerset(
    job_objects: Objects, example_job: JobTemplateParams, validate: Callable[[dict[str, Any]], None]
) -> None:
    values = (*AUTOSCALING_ON, "leaderWorkerSet.enabled=true", "jobTemplates.weightSync.mode=sidecar")
    multi_node = dataclasses.replace(example_job, engine_gpus=8, tp_size=16, engine_nodes=2)
    objects = fitted_autoscalers(job_objects("gpu", values, multi_node))
    (hpa,) = _engine_hpas(objects)
    (lws,) = by_kind(objects, "LeaderWorkerSet")

    validate(hpa)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": lws["metadata"]["name"],
    }


def test_an_invalid_target_value_is_refused_by_the_schema(render: Callable[..., Any]) -> None:
    with pytest.raises(Exception, match="targetValue"):
        render((), (*AUTOSCALING_ON, "jobTemplates.engine.autoscaling.targetValue=lots"))
