"""The per-job trainer on Kubernetes: a StatefulSet whose pods get distinct ranks and one rendezvous address (pod 0
through the headless Service), a PodDisruptionBudget over exactly the job's trainer pods, ingress to the
rendezvous port from the job's own trainer pods only, and checkpoints on a PVC per rank or one shared claim (the
sharded format's requirement, refused without it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from miles.common.testing.helm import by_kind
from miles.controller.job_templates import JobTemplateParams

pytestmark = pytest.mark.integration  # runs helm

Objects = Callable[..., list[dict[str, Any]]]
Renderer = Callable[..., list[dict[str, Any]]]
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
MASTER_PORT = 29500


def _one(objects: list[dict[str, Any]], kind: str, suffix: str = "-trainer") -> dict[str, Any]:
    (found,) = [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith(suffix)]
    return found


def _container(statefulset: dict[str, Any]) -> dict[str, Any]:
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("replicas", [2, 3])
def test_trainer_ranks_are_distinct_pods_with_one_master_address(
    job_objects: Objects, example_job: JobTemplateParams, replicas: int
) -> None:
    objects = job_objects("gpu", params=dataclasses.replace(example_job, trainer_replicas=replicas))
    statefulset, service = _one(objects, "StatefulSet"), _one(objects, "Service")
    spec = statefulset["spec"]
    assert spec["replicas"] == replicas and spec["podManagementPolicy"] == "Parallel"
    env = _env(_container(statefulset))
    assert env["MILES_TRAINER_WORLD_SIZE"] == str(replicas)
    # The rank is the pod's index (the StatefulSet controller labels pod <name>-i with i, 0 <= i < replicas): one
    # distinct rank per pod, and restarting a container in place keeps it.
    assert env["MILES_TRAINER_RANK"] == {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}
    # Every pod has the same master: pod 0's stable name under the headless Service the StatefulSet is governed by.
    name = statefulset["metadata"]["name"]
    assert spec["serviceName"] == service["metadata"]["name"]
    assert env["MILES_TRAINER_MASTER_ADDR"] == f"{name}-0.{service['metadata']['name']}"
    assert env["MILES_TRAINER_MASTER_PORT"] == str(MASTER_PORT)
    assert {"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"} in _container(statefulset)["ports"]


def test_the_headless_service_resolves_every_rank_before_it_is_ready(job_objects: Objects) -> None:
    """Ranks rendezvous before rank 0 serves its probes, so pod 0's DNS name must resolve while it is not ready."""
    objects = job_objects("default")
    statefulset, service = _one(objects, "StatefulSet"), _one(objects, "Service")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert _matches(service["spec"]["selector"], pod_labels)
    assert service["spec"]["selector"]["miles.dev/job"] == "gsm8k-7"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["dist"]["port"] == MASTER_PORT and ports["dist"]["targetPort"] == "dist"


def test_a_disruption_budget_covers_exactly_the_jobs_trainer_pods(
    job_objects: Objects, example_job: JobTemplateParams
) -> None:
    objects = job_objects("default")
    budget = _one(objects, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 0  # evicting any rank stops every rank: drains wait for the job
    selector = budget["spec"]["selector"]["matchLabels"]
    assert _matches(selector, _one(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"])
    others = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet")]
    assert others and not any(_matches(selector, o["spec"]["template"]["metadata"]["labels"]) for o in others)
    other_job = job_objects("default", params=dataclasses.replace(example_job, job_id="other-1"))
    assert not _matches(selector, _one(other_job, "StatefulSet")["spec"]["template"]["metadata"]["labels"])

    assert _one(job_objects("default", ["jobTemplates.trainer.podDisruptionBudget.maxUnavailable=1"]),
                "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1  # fmt: skip
    assert not by_kind(job_objects("default", ["jobTemplates.trainer.podDisruptionBudget.enabled=false"]),
                       "PodDisruptionBudget")  # fmt: skip


def _ports_allowed(rule: dict[str, Any], port: int) -> bool:
    if "ports" not in rule:
        return True
    return any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"] if isinstance(p["port"], int))


def test_only_the_jobs_trainer_pods_reach_the_rendezvous_port(
    job_objects: Objects, example_job: JobTemplateParams
) -> None:
    """The per-job ingress policy of the trainer pods: the rendezvous store (masterPort) is reachable from the same
    job's trainer pods, and from no other pod (engines reach every other port, for NCCL's update groups)."""
    objects = job_objects("default")
    policy = _one(objects, "NetworkPolicy", "-trainer-ingress")
    trainer_labels = _one(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert _matches(policy["spec"]["podSelector"]["matchLabels"], trainer_labels)
    other_trainer = _one(
        job_objects("default", params=dataclasses.replace(example_job, job_id="other-1")), "StatefulSet"
    )["spec"]["template"]["metadata"]["labels"]
    engine_labels = _one(objects, "Deployment", "-engine")["spec"]["template"]["metadata"]["labels"]
    reaching = []
    for rule in policy["spec"]["ingress"]:
        if not _ports_allowed(rule, MASTER_PORT):
            assert any(_matches(peer["podSelector"]["matchLabels"], engine_labels) for peer in rule["from"])
            assert _ports_allowed(rule, 29600) and _ports_allowed(rule, 41234)  # NCCL's update groups still get in
            continue
        for peer in rule["from"]:
            reaching.append(peer["podSelector"]["matchLabels"])
    assert reaching and all(_matches(selector, trainer_labels) for selector in reaching)
    assert not any(_matches(selector, other_trainer) for selector in reaching)


def test_checkpoints_go_to_a_pvc_per_rank_or_one_shared_claim_for_the_sharded_format(
    job_objects: Objects, render: Renderer
) -> None:
    per_rank = _one(job_objects("default"), "StatefulSet")
    assert _env(_container(per_rank))["MILES_TRAINER_CHECKPOINT_FORMAT"] == "full"
    assert per_rank["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"

    values = ["jobTemplates.trainer.checkpoints.sharedClaimName=trainer-checkpoints",
              "jobTemplates.trainer.checkpoints.format=sharded"]  # fmt: skip
    shared = _one(job_objects("default", values), "StatefulSet")
    assert "volumeClaimTemplates" not in shared["spec"]
    assert _env(_container(shared))["MILES_TRAINER_CHECKPOINT_FORMAT"] == "sharded"
    volumes = {v["name"]: v for v in shared["spec"]["template"]["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "trainer-checkpoints"}
    mounts = {m["name"]: m for m in _container(shared)["volumeMounts"]}
    assert mounts["checkpoints"] == {"name": "checkpoints", "mountPath": "/var/lib/miles/checkpoints",
                                     "subPath": "gsm8k-7"}  # fmt: skip

    with pytest.raises(RuntimeError, match=r"format=sharded needs jobTemplates\.trainer\.checkpoints\.sharedClaimName"):
        render([], ["jobTemplates.trainer.checkpoints.format=sharded"])
