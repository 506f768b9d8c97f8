"""A job's inference pools (judge, teacher): the job templates' inference-pool Deployment and Service, filled per
pool by the controller, are valid Kubernetes objects for every value set, run the release's engine kind without
weight-sync, are discovered by the router as the pool `<job>--<name>`, and only the router reaches their pods."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from miles.common.jobspec.job import JobSpec
from miles.common.testing.helm import by_kind
from miles.controller.backends.kubernetes_inference_pools import (
    COMPONENT,
    DEPLOYMENT_KEY,
    SERVICE_KEY,
    inference_pool_objects,
)
from miles.controller.job_templates import instantiate_job_templates

pytestmark = pytest.mark.integration  # runs helm

Renderer = Callable[..., list[dict[str, Any]]]
COMPONENT_LABEL = "app.kubernetes.io/component"
KINDS = {"default": "sglang", "ci": "cpu", "gpu": "sglang"}
"""The engine kind of each value set (the pool must ask for the release's)."""


def _judged_job(kind: str) -> JobSpec:
    gpus = 1 if kind == "sglang" else 0
    return JobSpec.model_validate(
        {
            "name": "judged",
            "model": {"path": "/models/qwen3-8b", "family": "qwen3"},
            "rollout": {"dataset": {"path": "data.jsonl"}, "agent": {"function": "a.b:c"}, "n_samples_per_prompt": 4},
            "train": {"mode": "async", "max_staleness": 2, "batch_size_groups": 2, "num_steps": 3},
            "resources": {"engines": {"replicas": 1, "kind": kind, "gpus_per_replica": gpus}},
            "inference_pools": [
                {"name": "judge", "model_path": "/models/judge-32b", "kind": kind, "gpus_per_replica": gpus}
            ],
        }
    )


@pytest.mark.parametrize("value_set", ["default", "ci", "gpu"])
def test_a_judge_pools_objects_are_valid_and_run_its_model_without_weight_sync(
    templates_of: Callable[..., dict[str, str]], validate: Callable[[dict[str, Any]], None], value_set: str
) -> None:
    templates = templates_of(value_set)
    objects = inference_pool_objects(templates, "gsm8k-7", _judged_job(KINDS[value_set]))
    assert sorted(o["kind"] for o in objects) == ["Deployment", "Service"]
    for obj in objects:
        validate(obj)
        assert obj["metadata"]["name"] == "miles-gsm8k-7-pool-judge"
        assert obj["metadata"]["labels"]["miles.dev/job"] == "gsm8k-7"
    deployment, service = by_kind(objects, "Deployment")[0], by_kind(objects, "Service")[0]
    pod = deployment["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["engine"]  # no weight-sync sidecar
    assert "weights" not in {volume["name"] for volume in pod["volumes"]}
    assert "/models/judge-32b" in pod["containers"][0]["args"]
    assert deployment["spec"]["template"]["metadata"]["labels"][COMPONENT_LABEL] == COMPONENT
    assert deployment["metadata"]["annotations"]["miles.dev/engine-kind"] == KINDS[value_set]
    # Discovered by the router (its k8s_label_selector is component=engine) as the router pool <job>--<name>.
    assert service["metadata"]["labels"][COMPONENT_LABEL] == "engine"
    assert service["metadata"]["labels"]["miles.dev/pool"] == "gsm8k-7--judge"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"][COMPONENT_LABEL] == COMPONENT


def test_the_jobs_own_objects_never_include_the_pool_templates(
    templates_of: Callable[..., dict[str, str]], example_job: Any
) -> None:
    templates = templates_of("default")
    assert {DEPLOYMENT_KEY, SERVICE_KEY} <= set(templates)
    objects = instantiate_job_templates(templates, example_job)
    assert not [o for o in objects if "${" in str(o) or "-pool-" in o["metadata"]["name"]]


def test_only_the_router_reaches_the_pools_engines(render: Renderer) -> None:
    policies = {p["metadata"]["name"]: p for p in by_kind(render(), "NetworkPolicy")}
    ingress = policies[f"miles-{COMPONENT}-ingress"]
    assert ingress["spec"]["podSelector"]["matchLabels"][COMPONENT_LABEL] == COMPONENT
    sources = {
        peer["podSelector"]["matchLabels"][COMPONENT_LABEL]: rule["ports"]
        for rule in ingress["spec"]["ingress"]
        for peer in rule["from"]
        if "podSelector" in peer
    }
    assert sources == {"rollout-router": [{"protocol": "TCP", "port": "http"}]}
    router_egress = policies["miles-rollout-router-egress"]["spec"]["egress"]
    to_pools = [r for r in router_egress if any(COMPONENT in str(peer) for peer in r.get("to", []))]
    assert to_pools and to_pools[0]["ports"] == [{"protocol": "TCP", "port": "http"}]
