"""The chart renders valid Kubernetes 1.34 objects whose workloads are probed, limited, locked down and placed
on the right node pool — for the default, CI and GPU-cluster values, and for the per-job templates."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from miles.common.testing.helm import by_kind, run_helm
from miles.controller.job_templates import JobTemplateParams, instantiate_job_templates

Renderer = Callable[..., list[dict[str, Any]]]

KUBERNETES_VERSION = "1.34.0"
VALUE_SETS = {"default": [], "ci": ["ci-values.yaml"], "gpu": ["ci-values.yaml", "gpu-values.yaml"]}
EXAMPLE_JOB = JobTemplateParams(
    job_id="gsm8k-7",
    model_path="s3://models/qwen3-8b",
    engine_replicas=4,
    engine_gpus=2,
    tp_size=2,
    rollout_worker_replicas=3,
    trainer_replicas=2,
    trainer_gpus=8,
)
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def job_templates(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The data of the <release>-job-templates ConfigMap (what the controller instantiates per job)."""
    (config_map,) = [obj for obj in by_kind(objects, "ConfigMap") if obj["metadata"]["name"].endswith("-job-templates")]
    return dict(config_map["data"])


def all_objects(render: Renderer, value_set: str) -> list[dict[str, Any]]:
    shared = render(VALUE_SETS[value_set])
    return shared + instantiate_job_templates(job_templates(shared), EXAMPLE_JOB)


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_lint_strict_passes(chart_dir: Path, value_set: str) -> None:
    args = ["lint", "--strict", str(chart_dir)]
    for name in VALUE_SETS[value_set]:
        args += ["-f", str(chart_dir / "ci" / name)]
    result = run_helm(chart_dir.parents[1], *args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_rendered_object_validates_against_kubernetes_schemas(render: Renderer, value_set: str) -> None:
    objects = all_objects(render, value_set)
    assert len(objects) > 40
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert obj["spec"]
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_an_invalid_rendered_object_is_caught(render: Renderer) -> None:
    objects = render([], ["controller.extraEnv[0].name=FOO", "controller.extraEnv[0].value=1"])
    (deployment,) = [obj for obj in by_kind(objects, "Deployment") if obj["metadata"]["name"] == "miles-controller"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_workloads_have_probes_limits_security_and_a_node_pool(render: Renderer, value_set: str) -> None:
    workloads = [
        obj for obj in all_objects(render, value_set) if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
    ]
    assert len(workloads) >= 8
    for workload in workloads:
        name = workload["metadata"]["name"]
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in spec["containers"]:
            where = f"{name}/{container['name']}"
            assert "livenessProbe" in container and "readinessProbe" in container, where
            assert container["resources"]["limits"], where
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where


def test_gpu_values_put_sglang_engines_on_rollout_pool_and_trainer_on_trainer_pool(render: Renderer) -> None:
    objects = all_objects(render, "gpu")
    engine = next(obj for obj in by_kind(objects, "Deployment") if obj["metadata"]["name"].endswith("gsm8k-7-engine"))
    trainer = next(obj for obj in by_kind(objects, "StatefulSet") if obj["metadata"]["name"].endswith("-trainer"))
    engine_spec, trainer_spec = pod_spec(engine), pod_spec(trainer)
    engine_container = engine_spec["containers"][0]
    assert engine_container["command"] == ["python3", "-m", "sglang.launch_server"]
    assert engine_container["args"][:2] == ["--model-path", "s3://models/qwen3-8b"]
    assert "--enable-metrics" in engine_container["args"]
    assert engine_container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert engine_spec["nodeSelector"] == {"cloud.example.com/node-group": "h200-rollout"}
    assert engine["spec"]["replicas"] == 4
    assert trainer_spec["nodeSelector"] == {"cloud.example.com/node-group": "h200-trainer"}
    assert trainer_spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert trainer["spec"]["replicas"] == 2
    assert trainer["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"
    assert any(obj["metadata"]["name"].endswith("gsm8k-7-weight-sync") for obj in by_kind(objects, "DaemonSet"))
    rescaled = instantiate_job_templates(
        job_templates(render(VALUE_SETS["gpu"])),
        JobTemplateParams(**{**EXAMPLE_JOB.__dict__, "engine_replicas": 16, "trainer_replicas": 1}),
    )
    sizes = {obj["kind"]: obj["spec"]["replicas"] for obj in rescaled if obj["kind"] in ("Deployment", "StatefulSet")}
    assert sizes["StatefulSet"] == 1
    assert 16 in [obj["spec"]["replicas"] for obj in by_kind(rescaled, "Deployment")]


def test_cpu_engine_is_selectable_for_a_gpu_less_demo(render: Renderer) -> None:
    objects = all_objects(render, "ci")
    engine = next(obj for obj in by_kind(objects, "Deployment") if obj["metadata"]["name"].endswith("-engine"))
    container = pod_spec(engine)["containers"][0]
    assert container["image"] == "registry.example.com/miles/miles-engine:0.1.0"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert "nodeSelector" not in pod_spec(engine)


def test_shared_services_are_deployments_with_hpa_where_designed(render: Renderer) -> None:
    objects = render([])
    deployments = {obj["metadata"]["labels"]["app.kubernetes.io/component"] for obj in by_kind(objects, "Deployment")}
    hpas = {obj["spec"]["scaleTargetRef"]["name"] for obj in by_kind(objects, "HorizontalPodAutoscaler")}
    assert deployments == {"controller", "session-server", "rollout-router", "buffer", "sandbox-gateway"}
    assert hpas == {"miles-session-server", "miles-rollout-router", "miles-sandbox-gateway"}
    (redis,) = by_kind(objects, "StatefulSet")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "20Gi"
