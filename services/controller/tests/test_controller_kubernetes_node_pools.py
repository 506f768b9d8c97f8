"""Per-job node pools on the Kubernetes backend, against the fake Kubernetes API (controller_kubernetes_testkit) with
the chart's own templates rendered with an extra `nodePools` entry: a job naming pools gets their placement on its
engines, rollout workers and trainer only, a job naming none gets exactly the chart's objects, and a pool the
release does not define is a 400 at submission with nothing stored or created."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from controller_kubernetes_testkit import chart_job_templates, fake_cluster

from miles.common.jobspec.job import JobSpec
from miles.controller.backends.kubernetes_job_spec import template_params
from miles.controller.backends.kubernetes_placement import node_pool_problem, place_on_node_pools
from miles.controller.job_templates import NODE_POOLS_KEY, instantiate_job_templates

pytestmark = pytest.mark.integration  # runs helm

COMPONENT = "app.kubernetes.io/component"
H200 = {
    "nodeSelector": {"miles.dev/pool": "h200", "cloud.example.com/accelerator": "h200"},
    "tolerations": [{"key": "example.com/h200", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
            }
        }
    },
}
PLACEMENT_KEYS = ("nodeSelector", "tolerations", "affinity")
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
DAEMONSET_MODE = ["jobTemplates.weightSync.mode=daemonset", "networkPolicy.nodeCidrs[0]=10.0.0.0/16"]


@pytest.fixture(scope="module")
def repo_root(request: pytest.FixtureRequest) -> Path:
    return Path(request.config.rootpath)


@pytest.fixture(scope="module")
def pools_values(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("values") / "node-pools.yaml"
    path.write_text(yaml.safe_dump({"nodePools": {"h200": H200}}))
    return path


@pytest.fixture(scope="module")
def templates(repo_root: Path, pools_values: Path) -> dict[str, str]:
    return chart_job_templates(repo_root, [pools_values])


def _spec(controller_kit: Any, **node_pools: str) -> JobSpec:
    """An SGLang job; `node_pools`: the node pool of some of its pools (`engines=`, `rollout_workers=`, `trainer=`)."""
    body = controller_kit.job_spec_body(num_steps=3)
    resources: dict[str, dict[str, Any]] = {
        "engines": {"replicas": 2, "kind": "sglang", "gpus_per_replica": 1},
        "rollout_workers": {"replicas": 2},
        "trainer": {"replicas": 1, "gpus_per_replica": 1},
    }
    for pool, node_pool in node_pools.items():
        resources[pool]["node_pool"] = node_pool
    return JobSpec.model_validate({**body, "resources": resources})


def _placement(obj: dict[str, Any]) -> dict[str, Any]:
    pod = obj["spec"]["template"]["spec"]
    return {key: pod[key] for key in PLACEMENT_KEYS if key in pod}


def _workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["labels"][COMPONENT]: o for o in objects if o["kind"] in WORKLOADS}


async def test_a_jobs_node_pools_place_its_own_pods_and_a_job_without_keeps_the_charts_objects(
    templates: dict[str, str], controller_kit: Any
) -> None:
    placed = _spec(controller_kit, engines="h200", rollout_workers="rollout")
    plain = _spec(controller_kit)
    async with fake_cluster(templates) as (api, _, backend):
        await backend.check_spec(placed)
        await backend.check_spec(plain)
        await backend.start("jpools000001", placed)
        await backend.start("jplain000001", plain)
        created = [*api.of_job("jpools000001"), *api.of_job("jplain000001")]
        assert api.num_validated == len(created)  # every object passed kubernetes-validate (strict) on create

        workloads = _workloads(api.of_job("jpools000001"))
        assert _placement(workloads["engine"]) == H200
        rollout = json.loads(templates[NODE_POOLS_KEY])["pools"]["rollout"]
        assert _placement(workloads["rollout-worker"]) == {k: v for k, v in rollout.items() if v}
        chart = _workloads(instantiate_job_templates(templates, template_params("jpools000001", placed)))
        assert _placement(workloads["trainer"]) == _placement(chart["trainer"])  # not named: the chart's
        assert _placement(workloads["weight-sync-origin"]) == _placement(chart["weight-sync-origin"])

        # The job without node pools: its pod templates are exactly what the chart's templates say.
        expected = _workloads(instantiate_job_templates(templates, template_params("jplain000001", plain)))
        for component, workload in _workloads(api.of_job("jplain000001")).items():
            assert workload["spec"]["template"] == expected[component]["spec"]["template"], component
            assert "example.com/h200" not in str(_placement(workload))


async def test_a_trainer_pool_places_the_trainer_only(templates: dict[str, str], controller_kit: Any) -> None:
    spec = _spec(controller_kit, trainer="h200")
    objects = instantiate_job_templates(templates, template_params("jtrainer0001", spec))
    placed, chart = _workloads(place_on_node_pools(objects, spec, templates)), _workloads(objects)
    assert _placement(placed["trainer"]) == H200
    assert all(placed[c] == chart[c] for c in chart if c != "trainer")


def test_daemonset_mode_engines_and_their_daemons_follow_the_pool_and_keep_the_job_selector(
    repo_root: Path, pools_values: Path, controller_kit: Any
) -> None:
    templates = chart_job_templates(repo_root, [pools_values], DAEMONSET_MODE)
    spec = _spec(controller_kit, engines="h200")
    objects = instantiate_job_templates(templates, template_params("jdaemons0001", spec))
    placed = _workloads(place_on_node_pools(objects, spec, templates))
    for component in ("engine", "weight-sync"):
        placement = _placement(placed[component])
        assert placement["nodeSelector"] == {**H200["nodeSelector"], "miles.dev/job": "jdaemons0001"}, component
        assert placement["tolerations"] == H200["tolerations"] and placement["affinity"] == H200["affinity"]


async def test_a_pool_the_release_does_not_define_is_a_400_naming_the_field_and_nothing_is_stored(
    templates: dict[str, str], redis_url: str, controller_kit: Any
) -> None:
    kit = controller_kit
    async with (
        fake_cluster(templates) as (api, _, backend),
        kit.running(kit.make_settings(redis_url), backend) as client,
    ):
        body = kit.job_spec_body(num_steps=3)
        resources = {"engines": {"replicas": 1, "kind": "sglang", "gpus_per_replica": 1}}
        for pool, field in (("engines", "resources.engines.node_pool"), ("trainer", "resources.trainer.node_pool")):
            wanted = {**resources, pool: {**resources.get(pool, {}), "node_pool": "a100-spot"}}
            response = await client.post("/v1/jobs", json={**body, "resources": wanted})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["field"] == field
            assert "'a100-spot'" in error["message"] and "'h200'" in error["message"]
        assert (await client.get("/v1/jobs")).json()["jobs"] == []
        assert [path for method, path in api.requests if method == "POST"] == []
        defined = {**resources, "trainer": {"node_pool": "h200"}}
        accepted = await client.post("/v1/jobs", json={**body, "resources": defined})
        assert accepted.status_code == 201, accepted.text


def test_a_chart_without_node_pools_refuses_every_named_pool(templates: dict[str, str], controller_kit: Any) -> None:
    older = {key: text for key, text in templates.items() if key != NODE_POOLS_KEY}
    spec = _spec(controller_kit, rollout_workers="cpu")
    assert node_pool_problem(spec, older) == (
        "resources.rollout_workers.node_pool",
        "resources.rollout_workers.node_pool 'cpu' is not a node pool of this release (the chart's nodePools: []); "
        "name one of them, or leave it unset for the chart's placement",
    )
    assert node_pool_problem(_spec(controller_kit), older) is None
