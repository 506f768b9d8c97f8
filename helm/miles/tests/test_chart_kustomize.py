"""k8s/: the kustomize base and overlays render with kubectl's built-in kustomize (its Helm generator inflates
helm/miles) into valid Kubernetes 1.34 objects — a GPU-less kind demo and a GPU cluster, each instantiating the
per-job templates the way its cluster needs."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from miles.common.testing.helm import by_kind, helm_binary
from miles.controller.job_templates import JobTemplateParams, instantiate_job_templates

pytestmark = pytest.mark.integration  # runs helm and kubectl kustomize

REPO_ROOT = Path(__file__).resolve().parents[3]
K8S_DIR = REPO_ROOT / "k8s"
CLUSTER_SCOPED = {"Namespace", "PersistentVolume"}


def kubectl_binary() -> str:
    """`.tools/bin/kubectl` (installed by `make setup` with helm), else one on PATH."""
    local = REPO_ROOT / ".tools" / "bin" / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError("kubectl not found: run `make setup` (it installs kubectl into .tools/bin)")
    return found


@functools.cache
def kustomize(path: str) -> tuple[dict[str, Any], ...]:
    command = [kubectl_binary(), "kustomize", str(K8S_DIR / path)]
    if path != "base":
        helm = str(Path(helm_binary(REPO_ROOT)).resolve())
        command += ["--enable-helm", "--helm-command", helm, "--load-restrictor", "LoadRestrictionsNone"]
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return tuple(document for document in yaml.safe_load_all(result.stdout) if document)


def job_of(objects: tuple[dict[str, Any], ...], example_job: JobTemplateParams) -> list[dict[str, Any]]:
    (templates,) = [o for o in by_kind(list(objects), "ConfigMap") if o["metadata"]["name"] == "miles-job-templates"]
    return instantiate_job_templates(templates["data"], example_job)


def named(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (found,) = [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith(suffix)]
    return found


def test_base_holds_the_namespaces() -> None:
    namespaces = {o["metadata"]["name"]: o["metadata"]["labels"] for o in kustomize("base")}
    assert set(namespaces) == {"miles", "miles-sandboxes"}
    assert namespaces["miles"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("overlay", ["kind", "gpu"])
def test_overlays_render_valid_objects_in_their_namespaces(
    overlay: str, validate: Callable[[dict[str, Any]], None], example_job: JobTemplateParams
) -> None:
    objects = kustomize(f"overlays/{overlay}")
    assert len(objects) > 50
    for obj in [*objects, *job_of(objects, example_job)]:
        validate(obj)
    for obj in objects:
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in CLUSTER_SCOPED:
            assert namespace is None, obj["metadata"]["name"]
        elif obj["metadata"]["name"] == "miles-sandbox-gateway" and obj["kind"] in ("Role", "RoleBinding"):
            assert namespace == "miles-sandboxes"
        else:
            assert namespace == "miles", f"{obj['kind']} {obj['metadata']['name']}"


def test_kind_overlay_is_a_gpu_less_demo(example_job: JobTemplateParams) -> None:
    objects = kustomize("overlays/kind")
    cpu_job = dataclasses.replace(example_job, engine_gpus=0, trainer_gpus=0)
    job = job_of(objects, cpu_job)
    for workload in [o for o in [*objects, *job] if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]:
        pod = workload["spec"]["template"]["spec"]
        assert "nodeSelector" not in pod and "tolerations" not in pod, workload["metadata"]["name"]
        for container in pod["containers"]:
            assert container["resources"]["limits"].get("nvidia.com/gpu", "0") == "0", workload["metadata"]["name"]
    engine = named(job, "Deployment", "-engine")["spec"]["template"]["spec"]
    assert engine["containers"][0]["image"] == "miles-engine:0.1.0"
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in engine["volumes"]
    assert not [o for o in by_kind(list(objects), "HorizontalPodAutoscaler")]
    (claim,) = by_kind(list(objects), "PersistentVolumeClaim")
    (volume,) = by_kind(list(objects), "PersistentVolume")
    assert claim["spec"]["volumeName"] == volume["metadata"]["name"]


def test_gpu_overlay_puts_sglang_on_the_rollout_pool_and_the_trainer_on_the_trainer_pool(
    example_job: JobTemplateParams,
) -> None:
    objects = kustomize("overlays/gpu")
    job = job_of(objects, example_job)
    engine = named(job, "Deployment", "-engine")["spec"]["template"]["spec"]
    trainer = named(job, "StatefulSet", "-trainer")["spec"]["template"]["spec"]
    assert engine["containers"][0]["image"].startswith("docker.io/lmsysorg/sglang:")
    assert engine["nodeSelector"] == {"cloud.example.com/node-group": "h200-rollout"}
    assert engine["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(example_job.engine_gpus)
    assert trainer["nodeSelector"] == {"cloud.example.com/node-group": "h200-trainer"}
    assert trainer["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(example_job.trainer_gpus)
    assert not by_kind(list(objects), "Secret") and not by_kind(list(objects), "StatefulSet")
    assert named(list(objects), "Deployment", "miles-controller")["spec"]["replicas"] == 2
    assert {o["kind"] for o in objects} >= {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
