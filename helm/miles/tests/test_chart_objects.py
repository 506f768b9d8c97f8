"""The chart renders valid Kubernetes 1.34 objects whose workloads are probed, limited, locked down and placed
on the right node pool — for the default, CI and GPU-cluster values, and for the per-job templates."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from miles.common.testing.helm import by_kind, run_helm
from miles.controller.job_templates import JobTemplateParams

pytestmark = pytest.mark.integration  # runs helm

Renderer = Callable[..., list[dict[str, Any]]]
Objects = Callable[..., list[dict[str, Any]]]
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def named(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (found,) = [obj for obj in by_kind(objects, kind) if obj["metadata"]["name"].endswith(suffix)]
    return found


@pytest.mark.parametrize("value_set", ["default", "ci", "gpu"])
def test_helm_lint_strict_passes(chart_dir: Path, value_sets: dict[str, tuple[str, ...]], value_set: str) -> None:
    args = ["lint", "--strict", str(chart_dir)]
    for name in value_sets[value_set]:
        args += ["-f", str(chart_dir / "ci" / name)]
    result = run_helm(chart_dir.parents[1], *args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("value_set", ["default", "ci", "gpu"])
def test_every_rendered_object_validates_against_kubernetes_schemas(
    all_objects: Objects, validate: Callable[[dict[str, Any]], None], value_set: str
) -> None:
    objects = all_objects(value_set)
    assert len(objects) > 40
    for obj in objects:
        validate(obj)


def test_an_invalid_rendered_object_is_caught(
    render: Renderer, validate: Callable[[dict[str, Any]], None], job_objects: Objects
) -> None:
    """A value the schema lets through but Kubernetes refuses (a misspelt EnvVar field, passed through as is)
    renders an object that validation rejects, in a shared Deployment and in an instantiated per-job one."""
    typo = ["{}.extraEnv[0].name=HF_HOME", "{}.extraEnv[0].vaule=/tmp/hf"]
    objects = render([], [item.format("controller") for item in typo])
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(named(objects, "Deployment", "miles-controller"))
    per_job = job_objects("default", [item.format("jobTemplates.engine") for item in typo])
    engine = named(per_job, "Deployment", "-engine")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(engine)


@pytest.mark.parametrize("value_set", ["default", "ci", "gpu"])
def test_workloads_have_probes_limits_security_and_no_service_links(all_objects: Objects, value_set: str) -> None:
    workloads = [obj for obj in all_objects(value_set) if obj["kind"] in WORKLOAD_KINDS]
    assert len(workloads) >= 9
    for workload in workloads:
        name = workload["metadata"]["name"]
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        # Service links would inject MILES_<SERVICE>_PORT=tcp://... into pods whose settings read MILES_*.
        assert spec["enableServiceLinks"] is False, name
        assert spec["automountServiceAccountToken"] is (name.endswith(("controller", "router", "gateway"))), name
        for container in spec["containers"]:
            where = f"{name}/{container['name']}"
            assert "livenessProbe" in container and "readinessProbe" in container, where
            assert container["resources"]["limits"], where
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where


def test_gpu_values_put_sglang_engines_on_rollout_pool_and_trainer_on_trainer_pool(
    all_objects: Objects, job_objects: Objects, example_job: JobTemplateParams
) -> None:
    objects = all_objects("gpu")
    engine, trainer = named(objects, "Deployment", "gsm8k-7-engine"), named(objects, "StatefulSet", "-trainer")
    engine_spec, trainer_spec = pod_spec(engine), pod_spec(trainer)
    engine_container = engine_spec["containers"][0]
    assert engine_container["command"] == ["python3", "-m", "sglang.launch_server"]
    args = engine_container["args"]
    assert args[:2] == ["--model-path", "/models/qwen3-8b"]
    assert args[args.index("--tp-size") + 1] == "2" and "--enable-metrics" in args
    assert engine_container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # daemonset mode: engines on the job's dedicated rollout nodes, one per node on the host network.
    assert engine_spec["nodeSelector"] == {"cloud.example.com/node-group": "h200-rollout", "miles.dev/job": "gsm8k-7"}
    assert engine_spec["hostNetwork"] is True
    assert engine["spec"]["replicas"] == 4
    assert trainer_spec["nodeSelector"] == {"cloud.example.com/node-group": "h200-trainer"}
    assert {t["key"] for t in trainer_spec["tolerations"]} == {"nvidia.com/gpu", "dedicated"}
    assert trainer_spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert trainer["spec"]["replicas"] == 2
    assert trainer["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"
    daemons = named(objects, "DaemonSet", "gsm8k-7-weight-sync")
    assert pod_spec(daemons)["nodeSelector"] == engine_spec["nodeSelector"]
    # Each pool is sized per job, independently of the other.
    resized = job_objects(
        "gpu", params=JobTemplateParams(**{**example_job.__dict__, "engine_replicas": 16, "trainer_gpus": 4})
    )
    assert named(resized, "Deployment", "-engine")["spec"]["replicas"] == 16
    resized_trainer = named(resized, "StatefulSet", "-trainer")
    assert resized_trainer["spec"]["replicas"] == 2
    assert pod_spec(resized_trainer)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert (
        pod_spec(named(resized, "Deployment", "-engine"))["containers"][0]["resources"]["limits"]
        == (engine_container["resources"]["limits"])
    )


def test_sidecar_mode_runs_weight_sync_in_every_engine_pod_on_the_pod_network(job_objects: Objects) -> None:
    engine = pod_spec(named(job_objects("default"), "Deployment", "-engine"))
    assert [c["name"] for c in engine["containers"]] == ["engine", "weight-sync"]
    assert "hostNetwork" not in engine
    assert engine["nodeSelector"] == {"miles.dev/pool": "rollout"}
    assert not by_kind(job_objects("default"), "DaemonSet")


def test_cpu_engine_is_selectable_for_a_gpu_less_demo(job_objects: Objects) -> None:
    engine = named(job_objects("ci"), "Deployment", "-engine")
    container = pod_spec(engine)["containers"][0]
    assert container["image"] == "registry.example.com/miles/miles-engine:0.1.0"
    assert container["args"][:2] == ["--model-path", "/models/qwen3-8b"]
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


def test_external_redis_replaces_the_statefulset_and_its_egress(render: Renderer) -> None:
    external = [
        "redis.enabled=false",
        "redis.externalUrl=rediss://u:p@redis.example.com:6380/0",
        "redis.externalEgress[0].to[0].ipBlock.cidr=10.20.0.0/16",
        "redis.externalEgress[0].ports[0].port=6380",
    ]
    objects = render([], external)
    assert not by_kind(objects, "StatefulSet")
    assert by_kind(objects, "Secret")[0]["stringData"]["redis-url"] == "rediss://u:p@redis.example.com:6380/0"
    egress = {p["metadata"]["name"]: p["spec"].get("egress", []) for p in by_kind(objects, "NetworkPolicy")}
    to_redis = {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 6380}]}
    for client in ("controller", "session-server", "buffer", "rollout-worker"):
        assert to_redis in egress[f"miles-{client}-egress"], client
    assert to_redis not in egress["miles-trainer-egress"]
    with pytest.raises(RuntimeError, match=r"redis\.externalEgress is required"):
        render([], external[:2])
    assert not by_kind(render([], [*external[:2], "networkPolicy.enabled=false"]), "NetworkPolicy")
