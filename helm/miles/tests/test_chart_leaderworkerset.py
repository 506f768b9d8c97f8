"""Multi-node engines: with `leaderWorkerSet.enabled`, a job whose tensor parallelism spans two nodes gets an engine
LeaderWorkerSet (valid against the LWS v0.10.0 CRD schema, vendored in miles.common.testing.crds) instead of the
engine Deployment: groups of two pods restarted together, SGLang's multi-node flags on leader and worker, and only
the leader behind the engine Service the router discovers."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest

from miles.common.errors import InvalidArgumentError
from miles.common.testing.crd_schemas import validate_custom_object
from miles.common.testing.helm import by_kind
from miles.controller.engine_args import with_engine_args
from miles.controller.job_templates import ENGINE_LWS_TEMPLATE_KEY, JobTemplateParams, instantiate_job_templates

pytestmark = pytest.mark.integration  # runs helm

LWS_ON = ("leaderWorkerSet.enabled=true",)
GPU_LWS_ON = (*LWS_ON, "jobTemplates.weightSync.mode=sidecar")  # the gpu values run weight-sync daemons
COMPONENT = "app.kubernetes.io/component"
TP_OVER_TWO_NODES = JobTemplateParams(
    job_id="big-7",
    model_path="/models/qwen3-235b",
    engine_replicas=2,
    engine_gpus=8,
    tp_size=16,
    engine_nodes=2,
    rollout_worker_replicas=2,
    trainer_replicas=2,
    trainer_gpus=8,
)
Objects = Callable[..., list[dict[str, Any]]]


def _engine_lws(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (lws,) = by_kind(objects, "LeaderWorkerSet")
    return lws


def _engine_container(pod_template: dict[str, Any]) -> dict[str, Any]:
    (engine,) = [c for c in pod_template["spec"]["containers"] if c["name"] == "engine"]
    return engine


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("value_set", ["default", "gpu"])
def test_tp_over_two_nodes_renders_a_leaderworkerset_valid_against_the_lws_crd(
    value_set: str, job_objects: Objects
) -> None:
    objects = job_objects(value_set, GPU_LWS_ON, TP_OVER_TWO_NODES)
    lws = _engine_lws(objects)
    validate_custom_object(lws)
    assert lws["metadata"]["name"] == "miles-big-7-engine"
    assert lws["spec"]["replicas"] == 2
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # the leader is ready only once its workers joined
    engine_deployments = [o for o in by_kind(objects, "Deployment") if o["metadata"]["labels"][COMPONENT] == "engine"]
    assert engine_deployments == []


def test_leader_and_worker_run_sglang_with_the_multi_node_flags(job_objects: Objects) -> None:
    group = _engine_lws(job_objects("default", LWS_ON, TP_OVER_TWO_NODES))["spec"]["leaderWorkerTemplate"]
    leader = _engine_container(group["leaderTemplate"])["args"]
    worker = _engine_container(group["workerTemplate"])["args"]
    for args in (leader, worker):
        assert _flag(args, "--tp-size") == "16"  # every rank of the replica, on both nodes
        assert _flag(args, "--nnodes") == "2"
        assert _flag(args, "--dist-init-addr") == "$(LWS_LEADER_ADDRESS):20000"
    assert _flag(leader, "--node-rank") == "0"
    assert _flag(worker, "--node-rank") == "$(LWS_WORKER_INDEX)"
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        gpus = _engine_container(template)["resources"]["limits"]["nvidia.com/gpu"]
        assert str(gpus) == "8"


def test_only_the_leader_is_an_engine_for_the_router_and_weight_sync(job_objects: Objects) -> None:
    objects = job_objects("default", LWS_ON, TP_OVER_TWO_NODES)
    group = _engine_lws(objects)["spec"]["leaderWorkerTemplate"]
    (service,) = [o for o in by_kind(objects, "Service") if o["metadata"]["name"] == "miles-big-7-engine"]
    assert service["metadata"]["labels"]["miles.dev/pool"] == "big-7"
    selector = service["spec"]["selector"].items()
    assert selector <= group["leaderTemplate"]["metadata"]["labels"].items()
    assert not selector <= group["workerTemplate"]["metadata"]["labels"].items()
    assert group["workerTemplate"]["metadata"]["labels"][COMPONENT] == "engine-worker"
    leader_containers = [c["name"] for c in group["leaderTemplate"]["spec"]["containers"]]
    assert leader_containers == ["engine", "weight-sync"]
    worker = _engine_container(group["workerTemplate"])
    assert [c["name"] for c in group["workerTemplate"]["spec"]["containers"]] == ["engine"]
    assert "readinessProbe" not in worker and "ports" not in worker  # SGLang serves HTTP on rank 0 only


@pytest.mark.parametrize("role", ["leaderTemplate", "workerTemplate"])
def test_the_group_pods_are_valid_pods(role: str, job_objects: Objects) -> None:
    template = _engine_lws(job_objects("gpu", GPU_LWS_ON, TP_OVER_TWO_NODES))["spec"]["leaderWorkerTemplate"][role]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", **template["metadata"]},
        "spec": template["spec"],
    }
    kubernetes_validate.validate(pod, "1.34.0", strict=True)


def test_a_single_node_job_keeps_the_engine_deployment_on_a_release_with_lws(
    job_objects: Objects, example_job: JobTemplateParams
) -> None:
    objects = job_objects("default", LWS_ON, example_job)
    assert by_kind(objects, "LeaderWorkerSet") == []
    assert [o for o in by_kind(objects, "Deployment") if o["metadata"]["labels"][COMPONENT] == "engine"]


def test_per_job_engine_flags_reach_every_rank_of_the_group(job_objects: Objects) -> None:
    objects = job_objects("default", LWS_ON, TP_OVER_TWO_NODES)
    flagged = with_engine_args(objects, ["--enable-return-routed-experts"])
    group = _engine_lws(flagged)["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        assert "--enable-return-routed-experts" in _engine_container(group[role])["args"]
    assert "--enable-return-routed-experts" not in str(_engine_lws(objects))  # the input is not changed


def test_lws_is_off_by_default_and_a_multi_node_job_then_fails_loudly(
    templates_of: Callable[..., dict[str, str]], render: Callable[..., list[dict[str, Any]]]
) -> None:
    templates = templates_of("default")
    assert ENGINE_LWS_TEMPLATE_KEY not in templates
    with pytest.raises(InvalidArgumentError, match=r"leaderWorkerSet\.enabled"):
        instantiate_job_templates(templates, TP_OVER_TWO_NODES)
    resources = {r for role in by_kind(render(), "Role") for rule in role["rules"] for r in rule["resources"]}
    assert "leaderworkersets" not in resources


def test_the_controller_may_manage_leaderworkersets_when_enabled(render: Callable[..., list[dict[str, Any]]]) -> None:
    (role,) = [r for r in by_kind(render((), LWS_ON), "Role") if r["metadata"]["name"] == "miles-controller"]
    (rule,) = [rule for rule in role["rules"] if "leaderworkersets" in rule["resources"]]
    assert rule["apiGroups"] == ["leaderworkerset.x-k8s.io"]
    assert {"create", "get", "list", "patch", "delete"} <= set(rule["verbs"])


def test_the_vendored_lws_schema_refuses_what_the_api_server_would(job_objects: Objects) -> None:
    lws = _engine_lws(job_objects("default", LWS_ON, TP_OVER_TWO_NODES))
    bad_policy = copy.deepcopy(lws)
    bad_policy["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RestartEverything"
    with pytest.raises(ValueError, match=r"spec\.leaderWorkerTemplate\.restartPolicy"):
        validate_custom_object(bad_policy)
    unknown_field = copy.deepcopy(lws)
    unknown_field["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    with pytest.raises(ValueError, match="groupSize"):
        validate_custom_object(unknown_field)


def _per_job_sources(objects: list[dict[str, Any]], policy: str) -> dict[str, list[Any]]:
    """Component a per-job ingress policy admits -> the ports it admits it on (absent: every port)."""
    (found,) = [o for o in by_kind(objects, "NetworkPolicy") if o["metadata"]["name"] == policy]
    admitted: dict[str, list[Any]] = {}
    for rule in found["spec"]["ingress"]:
        for peer in rule["from"]:
            labels = peer["podSelector"]["matchLabels"]
            assert labels["miles.dev/job"] == "big-7"  # the same job only
            admitted[labels[COMPONENT]] = rule.get("ports", [])
    return admitted


def test_the_pods_of_one_group_reach_each_other_on_every_port_within_the_job(job_objects: Objects) -> None:
    objects = job_objects("default", LWS_ON, TP_OVER_TWO_NODES)
    to_worker = _per_job_sources(objects, "miles-big-7-engine-worker-ingress")
    assert to_worker == {"engine": [], "engine-worker": []}  # rendezvous, then NCCL's own ports
    assert _per_job_sources(objects, "miles-big-7-engine-ingress")["engine-worker"] == []
    to_trainer = _per_job_sources(objects, "miles-big-7-trainer-ingress")["engine-worker"]
    assert to_trainer == _per_job_sources(objects, "miles-big-7-trainer-ingress")["engine"]  # all but masterPort


def test_lws_with_weight_sync_daemons_fails_with_the_reason(render: Callable[..., list[dict[str, Any]]]) -> None:
    daemonset = ("jobTemplates.weightSync.mode=daemonset", "networkPolicy.nodeCidrs[0]=10.0.0.0/16")
    with pytest.raises(RuntimeError, match=r"leaderWorkerSet\.enabled needs jobTemplates\.weightSync\.mode=sidecar"):
        render((), (*LWS_ON, *daemonset))
