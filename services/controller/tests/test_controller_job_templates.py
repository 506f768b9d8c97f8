"""The per-job template factory: placeholders validated before they reach YAML, the spec ConfigMap contract,
ownership, addresses — on a small hand-written template set and on the chart's real templates (rendered by helm,
each instantiated object validated against the Kubernetes 1.34 schemas)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from miles.common.errors import InvalidArgumentError
from miles.common.testing.helm import by_kind, render_chart
from miles.controller.engine_args import names_flag, with_engine_args
from miles.controller.job_templates import (
    PLACEHOLDERS,
    SPEC_FILES,
    SPEC_MOUNT_PATH,
    JobAddresses,
    JobTemplateParams,
    engine_kind_of,
    instantiate_job_templates,
    job_spec_config_map,
    owned_by,
)

CHART_DIR = Path(__file__).resolve().parents[3] / "helm" / "miles"
ROUTING_FLAG = "--enable-return-routed-experts"
JOB = JobTemplateParams(
    job_id="math-3",
    model_path="/models/qwen3-8b",
    engine_replicas=2,
    engine_gpus=1,
    tp_size=1,
    rollout_worker_replicas=2,
    trainer_replicas=2,
    trainer_gpus=4,
)
SPEC = {"spec.json": {"name": "math"}, "trainer.json": {}, "rollout.json": {"rollout": {}}, "weightsync.json": {}}
SMALL_TEMPLATES = {
    "spec-configmap.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: rel-miles-${JOB_ID}-spec\ndata: {}\n",
    "a-service.yaml": (
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: rel-miles-${JOB_ID}-trainer\n"
        "spec:\n  ports:\n    - {name: grpc, port: 50052}\n"
    ),
    "trainer-service.yaml": (
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: rel-miles-${JOB_ID}-trainer\n"
        "spec:\n  ports:\n    - {name: grpc, port: 50052}\n"
    ),
    "weight-sync-origin-service.yaml": (
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: rel-miles-${JOB_ID}-weight-sync-origin\n"
        "spec:\n  ports:\n    - {name: grpc, port: 50053}\n"
    ),
    "z-deployment.yaml": (
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: rel-miles-${JOB_ID}-engine\n"
        "spec:\n  replicas: ${ENGINE_REPLICAS}\n---\n# empty documents are skipped\n"
    ),
}


@functools.cache
def chart_templates(*set_values: str) -> dict[str, str]:
    objects = render_chart(CHART_DIR, [CHART_DIR / "ci" / "ci-values.yaml"], set_values)
    (config_map,) = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-job-templates")]
    return dict(config_map["data"])


def with_job(**changes: Any) -> JobTemplateParams:
    return dataclasses.replace(JOB, **changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"job_id": "Math_3"}, "job_id"),
        ({"job_id": "a" * 21}, "job_id"),
        ({"job_id": "-math"}, "job_id"),
        ({"model_path": "/models/x\nkind: Secret"}, "model_path"),
        ({"model_path": '/models/"x"'}, "model_path"),
        ({"engine_replicas": -1}, "engine_replicas"),
        ({"tp_size": 0}, "tp_size"),
        ({"trainer_gpus": 5000}, "trainer_gpus"),
        ({"rollout_worker_max_replicas": 1}, "rollout_worker_max_replicas"),
    ],
)
def test_placeholder_values_are_validated_naming_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as failure:
        with_job(**changes).placeholders()
    assert failure.value.field == field


def test_every_placeholder_has_a_value() -> None:
    values = JOB.placeholders()
    assert set(values) == set(PLACEHOLDERS)
    assert values["ROLLOUT_WORKER_MAX_REPLICAS"] == "2"
    assert with_job(rollout_worker_max_replicas=8).placeholders()["ROLLOUT_WORKER_MAX_REPLICAS"] == "8"


def test_templates_are_filled_in_key_order_without_the_spec_skeleton() -> None:
    objects = instantiate_job_templates(SMALL_TEMPLATES, JOB)
    assert [o["metadata"]["name"] for o in objects] == [
        "rel-miles-math-3-trainer",
        "rel-miles-math-3-trainer",
        "rel-miles-math-3-weight-sync-origin",
        "rel-miles-math-3-engine",
    ]
    assert objects[-1]["spec"]["replicas"] == 2


def test_an_unknown_placeholder_fails_loudly() -> None:
    templates = {**SMALL_TEMPLATES, "new.yaml": "kind: ConfigMap\nmetadata:\n  name: x-${GPU_TYPE}\n"}
    with pytest.raises(InvalidArgumentError, match=r"new\.yaml uses unknown placeholder \$\{GPU_TYPE\}"):
        instantiate_job_templates(templates, JOB)


def test_names_over_the_kubernetes_limits_are_refused() -> None:
    long_prefix = "r" * 40
    templates = {name: text.replace("rel-miles", long_prefix) for name, text in SMALL_TEMPLATES.items()}
    with pytest.raises(InvalidArgumentError, match="longer than 63 characters") as failure:
        instantiate_job_templates(templates, with_job(job_id="a" * 20))
    assert failure.value.field == "job_id"


def test_the_spec_config_map_carries_exactly_the_spec_files() -> None:
    config_map = job_spec_config_map(SMALL_TEMPLATES, JOB, SPEC)
    assert config_map["metadata"]["name"] == "rel-miles-math-3-spec"
    assert {key: json.loads(text) for key, text in config_map["data"].items()} == SPEC
    with pytest.raises(InvalidArgumentError, match="missing") as failure:
        job_spec_config_map(SMALL_TEMPLATES, JOB, {k: v for k, v in SPEC.items() if k != "trainer.json"})
    assert failure.value.field == "files"
    with pytest.raises(InvalidArgumentError, match="unknown"):
        job_spec_config_map(SMALL_TEMPLATES, JOB, {**SPEC, "extra.json": {}})


def test_owned_objects_point_at_the_created_spec_config_map() -> None:
    objects = instantiate_job_templates(SMALL_TEMPLATES, JOB)
    created = {**job_spec_config_map(SMALL_TEMPLATES, JOB, SPEC), "metadata": {"name": "rel-miles-math-3-spec"}}
    with pytest.raises(InvalidArgumentError, match="create it first"):
        owned_by(objects, created)
    created["metadata"]["uid"] = "0b6f2a4e-uid"
    owned = owned_by(objects, created)
    assert all(
        o["metadata"]["ownerReferences"]
        == [{"apiVersion": "v1", "kind": "ConfigMap", "name": "rel-miles-math-3-spec", "uid": "0b6f2a4e-uid"}]
        for o in owned
    )
    assert all("ownerReferences" not in o["metadata"] for o in objects)


@pytest.mark.integration  # helm
@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_chart_templates_instantiate_to_valid_objects_wired_to_the_spec_config_map(mode: str) -> None:
    """Every object the controller would create from the chart's templates is a valid Kubernetes 1.34 object,
    every per-job container reads its settings file from the mounted spec ConfigMap, and the addresses the
    controller dials name Services the templates create."""
    templates = chart_templates(f"jobTemplates.weightSync.mode={mode}", "networkPolicy.nodeCidrs[0]=10.0.0.0/16")
    spec_config_map = job_spec_config_map(templates, JOB, SPEC)
    objects = owned_by(
        instantiate_job_templates(templates, JOB),
        {**spec_config_map, "metadata": {**spec_config_map["metadata"], "uid": "u"}},
    )
    for obj in [spec_config_map, *objects]:
        kubernetes_validate.validate(obj, "1.34.0", strict=True)
    config_files = set()
    for workload in [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]:
        pod = workload["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "job-spec"]
        assert volume["configMap"]["name"] == spec_config_map["metadata"]["name"]
        for container in pod["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            files = [value for name, value in env.items() if name.endswith("_CONFIG_FILE")]
            if container["name"] == "engine":
                continue
            (path,) = files
            assert path.startswith(f"{SPEC_MOUNT_PATH}/") and path.rsplit("/", 1)[1] in SPEC_FILES
            assert {"name": "job-spec", "mountPath": SPEC_MOUNT_PATH, "readOnly": True} in container["volumeMounts"]
            config_files.add(path.rsplit("/", 1)[1])
    assert config_files == {"trainer.json", "rollout.json", "weightsync.json"}
    services = {o["metadata"]["name"]: o for o in by_kind(objects, "Service")}
    addresses = JobAddresses.of(templates, JOB.job_id)
    assert addresses.engine_service in services
    for address in (addresses.weightsync_origin, addresses.weightsync_peers_dns):
        host, port = address.split(":")
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
    rank0_host, rank0_port = addresses.trainer_rank0.split(":")
    trainer_service = rank0_host.split(".")[1]
    assert rank0_host.split(".")[0] == f"{trainer_service}-0"
    assert int(rank0_port) in [p["port"] for p in services[trainer_service]["spec"]["ports"]]


@pytest.mark.integration  # helm
def test_the_templates_say_which_engine_they_run() -> None:
    assert engine_kind_of(chart_templates()) == "cpu"
    assert engine_kind_of(chart_templates("jobTemplates.engine.kind=sglang")) == "sglang"
    assert engine_kind_of(SMALL_TEMPLATES) == ""


def _engine_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (engine,) = [
        o for o in by_kind(objects, "Deployment") if o["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    ]
    return engine


def _engine_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = _engine_deployment(objects)["spec"]["template"]["spec"]
    return pod


def test_a_flag_is_named_by_itself_its_value_form_or_its_negation() -> None:
    for args in ([ROUTING_FLAG], ["--x", f"{ROUTING_FLAG}=true"], ["--no-enable-return-routed-experts"]):
        assert names_flag(args, ROUTING_FLAG), args
    for args in ([], ["--enable-return-routed-experts-extra"], ["--model-path", "/m"]):
        assert not names_flag(args, ROUTING_FLAG), args


@pytest.mark.integration  # helm
@pytest.mark.parametrize("kind", ["cpu", "sglang"])
def test_per_job_engine_args_go_once_to_the_engine_container_and_the_charts_extra_args_win(kind: str) -> None:
    objects = instantiate_job_templates(chart_templates(f"jobTemplates.engine.kind={kind}"), JOB)
    flagged = with_engine_args(objects, [ROUTING_FLAG])
    before, after = _engine_pod(objects), _engine_pod(flagged)
    (engine_before,) = [c for c in before["containers"] if c["name"] == "engine"]
    (engine_after,) = [c for c in after["containers"] if c["name"] == "engine"]
    assert engine_after["args"] == [*engine_before["args"], ROUTING_FLAG]
    assert ROUTING_FLAG not in engine_before["args"]  # the input is not changed
    assert [c for c in after["containers"] if c["name"] != "engine"] == [
        c for c in before["containers"] if c["name"] != "engine"
    ]
    assert sum(a != b for a, b in zip(objects, flagged, strict=True)) == 1  # only the engine Deployment
    kubernetes_validate.validate(_engine_deployment(flagged), "1.34.0", strict=True)
    assert with_engine_args(flagged, [ROUTING_FLAG]) == flagged  # already there: not twice
    chart_named = instantiate_job_templates(
        chart_templates(f"jobTemplates.engine.kind={kind}", f"jobTemplates.engine.{kind}.extraArgs[0]={ROUTING_FLAG}"),
        JOB,
    )
    (engine,) = [c for c in _engine_pod(chart_named)["containers"] if c["name"] == "engine"]
    assert engine["args"].count(ROUTING_FLAG) == 1
    assert with_engine_args(chart_named, [ROUTING_FLAG]) == chart_named


def test_engine_args_without_an_engine_container_fail_loudly() -> None:
    with pytest.raises(InvalidArgumentError, match="no engine Deployment with a container named 'engine'"):
        with_engine_args(instantiate_job_templates(SMALL_TEMPLATES, JOB), [ROUTING_FLAG])
