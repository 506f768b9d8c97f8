"""The environment server's per-job templates: instantiated only for a job with an environment, its placeholders
validated before they reach YAML (the connector's args survive any JSON), the image the chart names for the
connector, and the job's rollout workers wired to its Service — on hand-written templates and on the chart's."""

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
from miles.controller.env_server_templates import (
    ENV_SERVER_IMAGES_ANNOTATION,
    ENV_SERVER_PLACEHOLDERS,
    ENVIRONMENT_URL_ENV,
    EnvironmentServerParams,
    env_server_image_of,
)
from miles.controller.job_templates import PLACEHOLDERS, JobAddresses, JobTemplateParams, instantiate_job_templates

CHART_DIR = Path(__file__).resolve().parents[3] / "helm" / "miles"
ENVIRONMENT = EnvironmentServerParams(connector="reasoning_gym", args_json='{"dataset": "leg_counting"}')
JOB = JobTemplateParams(
    job_id="rg-1",
    model_path="/models/tiny",
    engine_replicas=1,
    engine_gpus=0,
    tp_size=1,
    rollout_worker_replicas=2,
    trainer_replicas=1,
    trainer_gpus=0,
    environment=ENVIRONMENT,
)
IMAGES = {"reasoning_gym": "reg.example.com/miles-envserver-reasoning-gym:1.0", "my_pkg.env": "me/my-env:2"}
TEMPLATES = {
    "spec-configmap.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: rel-${JOB_ID}-spec\ndata: {}\n",
    "rollout-worker-deployment.yaml": (
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: rel-${JOB_ID}-rollout-worker\n"
        "  labels: {app.kubernetes.io/component: rollout-worker}\n"
        "spec:\n  template:\n    spec:\n      containers:\n        - name: rollout-worker\n"
        "          env: [{name: A, value: b}]\n"
    ),
    "env-server-deployment.yaml": (
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: rel-${JOB_ID}-env-server\n"
        "  labels: {app.kubernetes.io/component: env-server}\n"
        f"  annotations: {{{ENV_SERVER_IMAGES_ANNOTATION}: '{json.dumps(IMAGES)}'}}\n"
        "spec:\n  replicas: ${ENV_SERVER_REPLICAS}\n  template:\n    spec:\n      containers:\n"
        '        - {name: env-server, image: "${ENV_SERVER_IMAGE}",\n'
        '           args: [--connector, "${ENV_CONNECTOR}", --args, "${ENV_ARGS_JSON}"],\n'
        '           startupProbe: {failureThreshold: "${ENV_SERVER_STARTUP_FAILURES}"}}\n'
    ),
    "env-server-service.yaml": (
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: rel-${JOB_ID}-env-server\n"
        "  labels: {app.kubernetes.io/component: env-server}\nspec:\n  ports: [{name: http, port: 8090}]\n"
    ),
}


def with_environment(**changes: Any) -> JobTemplateParams:
    return dataclasses.replace(JOB, environment=dataclasses.replace(ENVIRONMENT, **changes))


def of_component(objects: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    (found,) = [
        o
        for o in by_kind(objects, kind)
        if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
    ]
    return found


def env_of(deployment: dict[str, Any], container: str) -> dict[str, Any]:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    return {item["name"]: item.get("value") for item in found.get("env", [])}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"connector": "reasoning-gym"}, "rollout.environment.connector"),
        ({"connector": 'x" --inject'}, "rollout.environment.connector"),
        ({"args_json": "[1, 2]"}, "rollout.environment.args"),
        ({"args_json": "{not json"}, "rollout.environment.args"),
        ({"args_json": json.dumps({"x": "y" * 70000})}, "rollout.environment.args"),
        ({"replicas": 0}, "rollout.environment.replicas"),
        ({"startup_timeout_s": 0.0}, "rollout.environment.startup_timeout_s"),
    ],
)
def test_environment_values_are_validated_naming_the_spec_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as failure:
        with_environment(**changes).placeholders()
    assert failure.value.field == field


def test_a_job_with_an_environment_fills_every_placeholder_but_the_charts_image() -> None:
    values = JOB.placeholders()
    assert set(values) == set(PLACEHOLDERS) | set(ENV_SERVER_PLACEHOLDERS) - {"ENV_SERVER_IMAGE"}
    assert values["ENV_SERVER_REPLICAS"] == "1"
    assert values["ENV_SERVER_STARTUP_FAILURES"] == "60"  # 600 s in periods of 10 s
    assert values["ENV_SERVER_PROGRESS_DEADLINE_S"] == "1200"  # the setup's 600 s, then the default 600 s
    slow = with_environment(startup_timeout_s=1795.5).placeholders()
    assert (slow["ENV_SERVER_STARTUP_FAILURES"], slow["ENV_SERVER_PROGRESS_DEADLINE_S"]) == ("180", "2396")


@pytest.mark.parametrize(
    "args",
    [
        {"dataset": "leg_counting", "size": 100, "seed": 7},
        {"quote": 'it\'s "quoted"', "newline": "a\nb\tc", "backslash": "C:\\x\\", "unicode": "é 中 \U0001f600"},
        {"yaml": "key: value\n- item\n---\n{a: [b]} # not a comment", "placeholder": "${JOB_ID} ${UNKNOWN}"},
        {"nested": {"list": [1, 2.5, None, True, {"deep": "x"}]}, "empty": {}},
    ],
    ids=["plain", "escapes", "yaml-and-placeholders", "nested"],
)
def test_the_connectors_args_reach_the_container_unchanged(args: dict[str, Any]) -> None:
    objects = instantiate_job_templates(TEMPLATES, with_environment(args_json=json.dumps(args)))
    (container,) = of_component(objects, "Deployment", "env-server")["spec"]["template"]["spec"]["containers"]
    assert container["args"][:3] == ["--connector", "reasoning_gym", "--args"]
    assert json.loads(container["args"][3]) == args


def test_the_image_is_the_charts_for_the_connector_and_its_map_is_dropped() -> None:
    objects = instantiate_job_templates(TEMPLATES, JOB)
    deployment = of_component(objects, "Deployment", "env-server")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGES["reasoning_gym"]
    assert "annotations" not in deployment["metadata"]
    custom = instantiate_job_templates(TEMPLATES, with_environment(connector="my_pkg.env"))
    assert of_component(custom, "Deployment", "env-server")["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "me/my-env:2"
    )
    with pytest.raises(InvalidArgumentError, match=r"no environment-server image for connector 'verifiers'") as no:
        instantiate_job_templates(TEMPLATES, with_environment(connector="verifiers"))
    assert no.value.field == "rollout.environment.connector"
    assert "reasoning_gym" in str(no.value)  # says which connectors the release has
    old_chart = {k: v for k, v in TEMPLATES.items() if not k.startswith("env-server-")}
    with pytest.raises(InvalidArgumentError, match="no environment-server templates: upgrade the chart"):
        env_server_image_of(old_chart, "reasoning_gym")


def test_the_workers_get_the_services_url_and_the_server_its_replicas() -> None:
    objects = instantiate_job_templates(TEMPLATES, with_environment(replicas=3))
    workers = of_component(objects, "Deployment", "rollout-worker")
    assert env_of(workers, "rollout-worker") == {"A": "b", ENVIRONMENT_URL_ENV: "http://rel-rg-1-env-server:8090"}
    grpc_service = TEMPLATES["env-server-service.yaml"].replace("http", "grpc")
    addresses = JobAddresses.of(
        {**TEMPLATES, "weight-sync-origin-service.yaml": grpc_service, "trainer-service.yaml": grpc_service}, "rg-1"
    )
    assert addresses.environment_url == "http://rel-rg-1-env-server:8090"
    assert of_component(objects, "Deployment", "env-server")["spec"]["replicas"] == 3
    (server,) = of_component(objects, "Deployment", "env-server")["spec"]["template"]["spec"]["containers"]
    assert server["startupProbe"]["failureThreshold"] == "60"
    # A URL the chart sets itself (extraEnv) wins.
    chart_set = dict(TEMPLATES)
    chart_set["rollout-worker-deployment.yaml"] = chart_set["rollout-worker-deployment.yaml"].replace(
        "{name: A, value: b}", f"{{name: {ENVIRONMENT_URL_ENV}, value: 'http://mine:1'}}"
    )
    mine = of_component(instantiate_job_templates(chart_set, JOB), "Deployment", "rollout-worker")
    assert env_of(mine, "rollout-worker") == {ENVIRONMENT_URL_ENV: "http://mine:1"}


def test_a_job_without_an_environment_gets_none_of_its_objects() -> None:
    objects = instantiate_job_templates(TEMPLATES, dataclasses.replace(JOB, environment=None))
    assert [o["metadata"]["name"] for o in objects] == ["rel-rg-1-rollout-worker"]
    assert env_of(objects[0], "rollout-worker") == {"A": "b"}


def test_a_chart_without_a_rollout_worker_container_fails_loudly() -> None:
    templates = {k: v for k, v in TEMPLATES.items() if k != "rollout-worker-deployment.yaml"}
    with pytest.raises(InvalidArgumentError, match="no rollout-worker Deployment with a container"):
        instantiate_job_templates(templates, JOB)


@functools.cache
def chart_templates(*set_values: str) -> dict[str, str]:
    objects = render_chart(CHART_DIR, [CHART_DIR / "ci" / "ci-values.yaml"], set_values)
    (config_map,) = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-job-templates")]
    return dict(config_map["data"])


@pytest.mark.integration  # helm
def test_the_charts_templates_give_valid_objects_for_every_connector_it_has_an_image_for() -> None:
    templates = chart_templates()
    for connector in ("reasoning_gym", "verifiers", "openenv", "harbor"):
        name = connector.replace("_", "-")
        assert env_server_image_of(templates, connector) == f"registry.example.com/miles/miles-envserver-{name}:0.1.0"
        objects = instantiate_job_templates(templates, with_environment(connector=connector))
        assert {o["kind"] for o in objects if o["metadata"]["name"] == "miles-rg-1-env-server"} == {
            "Deployment",
            "Service",
        }
        assert [
            o["metadata"]["name"] for o in by_kind(objects, "NetworkPolicy") if "env-server" in o["metadata"]["name"]
        ] == ["miles-rg-1-env-server-ingress"]
        for obj in objects:
            kubernetes_validate.validate(obj, "1.34.0", strict=True)
        workers = of_component(objects, "Deployment", "rollout-worker")
        assert env_of(workers, "rollout-worker")[ENVIRONMENT_URL_ENV] == "http://miles-rg-1-env-server:8090"
    without = instantiate_job_templates(templates, dataclasses.replace(JOB, environment=None))
    assert not [o for o in without if "env-server" in o["metadata"]["name"]]
