"""Multi-node engines on the Kubernetes backend, against the fake Kubernetes API (controller_kubernetes_testkit)
with the chart's templates rendered with `leaderWorkerSet.enabled`: a job whose tensor parallelism spans two nodes
gets an engine LeaderWorkerSet (validated against the vendored LWS CRD schema on create) instead of the engine
Deployment, reports its ready groups, is resized by patching its replicas and loses it with the job; on a release
without LeaderWorkerSet such a job is a 400 at submission with nothing stored or created; an engine node pool places
leaders and workers alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from controller_kubernetes_testkit import chart_job_templates, fake_cluster

from miles.common.jobspec.job import JobSpec
from miles.controller.backends.kubernetes_job_spec import template_params
from miles.controller.backends.kubernetes_placement import place_on_node_pools
from miles.controller.job_templates import ENGINE_LWS_TEMPLATE_KEY, instantiate_job_templates

pytestmark = pytest.mark.integration  # runs helm

COMPONENT = "app.kubernetes.io/component"
LWS_PATH = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/miles/leaderworkersets"
TWO_NODE_ENGINES = {"replicas": 2, "kind": "sglang", "gpus_per_replica": 8, "tp_size": 16, "nodes_per_replica": 2}


@pytest.fixture(scope="module")
def repo_root(request: pytest.FixtureRequest) -> Path:
    return Path(request.config.rootpath)


@pytest.fixture(scope="module")
def lws_templates(repo_root: Path) -> dict[str, str]:
    return chart_job_templates(repo_root, set_values=["leaderWorkerSet.enabled=true"])


@pytest.fixture(scope="module")
def plain_templates(repo_root: Path) -> dict[str, str]:
    return chart_job_templates(repo_root)


def _spec(controller_kit: Any, engines: dict[str, Any]) -> JobSpec:
    body = controller_kit.job_spec_body(num_steps=3)
    resources = {"engines": engines, "rollout_workers": {"replicas": 1}, "trainer": {"replicas": 1}}
    return JobSpec.model_validate({**body, "resources": resources})


def _of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


async def test_a_two_node_engine_job_runs_on_a_leaderworkerset_observed_resized_and_deleted_with_the_job(
    lws_templates: dict[str, str], controller_kit: Any
) -> None:
    spec = _spec(controller_kit, TWO_NODE_ENGINES)
    async with fake_cluster(lws_templates) as (api, _, backend):
        await backend.check_spec(spec)
        await backend.start("jlws0000001", spec)
        created = api.of_job("jlws0000001")
        assert api.num_validated == len(created)  # the LWS against its CRD schema, the rest with kubernetes-validate
        (lws,) = _of_kind(created, "LeaderWorkerSet")
        assert ("POST", LWS_PATH) in api.requests
        assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert lws["metadata"]["ownerReferences"][0]["kind"] == "ConfigMap"  # deleted with the job's spec
        engine_deployments = [
            o for o in _of_kind(created, "Deployment") if o["metadata"]["labels"][COMPONENT] == "engine"
        ]
        assert engine_deployments == []

        progress = await backend.observe("jlws0000001", spec)
        assert progress.pools == {"engines": 2, "rollout_workers": 1, "trainer": 1}
        assert progress.phase == "running"

        await backend.resize("jlws0000001", spec, engines=3, rollout_workers=None)
        assert ("PATCH", f"{LWS_PATH}/{lws['metadata']['name']}") in api.requests
        assert (await backend.observe("jlws0000001", spec)).pools["engines"] == 3

        await backend.start("jlws0000001", spec)  # a restarted controller adopts the existing LWS (409 -> read)
        assert len(_of_kind(api.of_job("jlws0000001"), "LeaderWorkerSet")) == 1

        await backend.stop("jlws0000001")
        assert api.of_job("jlws0000001") == []


async def test_a_single_node_job_keeps_its_engine_deployment_on_a_release_with_lws(
    lws_templates: dict[str, str], controller_kit: Any
) -> None:
    spec = _spec(controller_kit, {"replicas": 2, "kind": "sglang", "gpus_per_replica": 2, "tp_size": 2})
    async with fake_cluster(lws_templates) as (api, _, backend):
        await backend.start("jone0000001", spec)
        created = api.of_job("jone0000001")
        assert _of_kind(created, "LeaderWorkerSet") == []
        assert [o for o in _of_kind(created, "Deployment") if o["metadata"]["labels"][COMPONENT] == "engine"]
        assert (await backend.observe("jone0000001", spec)).pools["engines"] == 2
        assert not any(path.startswith(LWS_PATH) for _, path in api.requests)  # the LWS API is never called


async def test_a_multi_node_job_on_a_release_without_lws_is_a_400_and_nothing_is_stored(
    plain_templates: dict[str, str], redis_url: str, controller_kit: Any
) -> None:
    assert ENGINE_LWS_TEMPLATE_KEY not in plain_templates
    kit = controller_kit
    async with (
        fake_cluster(plain_templates) as (api, _, backend),
        kit.running(kit.make_settings(redis_url), backend) as client,
    ):
        body = kit.job_spec_body(num_steps=3)
        response = await client.post("/v1/jobs", json={**body, "resources": {"engines": TWO_NODE_ENGINES}})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["field"] == "resources.engines.nodes_per_replica"
        assert "leaderWorkerSet.enabled=true" in error["message"]
        assert (await client.get("/v1/jobs")).json()["jobs"] == []
        assert [path for method, path in api.requests if method == "POST"] == []


@pytest.mark.parametrize(
    ("engines", "message"),
    [
        ({"kind": "sglang", "gpus_per_replica": 8, "tp_size": 12, "nodes_per_replica": 8}, "multiple of"),
        ({"kind": "sglang", "gpus_per_replica": 4, "tp_size": 16, "nodes_per_replica": 2}, "exceeds gpus_per_replica"),
        ({"kind": "cpu", "nodes_per_replica": 2, "tp_size": 2}, "needs kind 'sglang'"),
    ],
)
async def test_impossible_multi_node_engines_are_a_422_naming_the_reason(
    engines: dict[str, Any], message: str, redis_url: str, controller_kit: Any, lws_templates: dict[str, str]
) -> None:
    kit = controller_kit
    async with (
        fake_cluster(lws_templates) as (_, _, backend),
        kit.running(kit.make_settings(redis_url), backend) as client,
    ):
        body = kit.job_spec_body(num_steps=3)
        response = await client.post("/v1/jobs", json={**body, "resources": {"engines": engines}})
        assert response.status_code == 422, response.text
        assert message in response.text


def test_an_engine_node_pool_places_the_leaders_and_the_workers(repo_root: Path, controller_kit: Any) -> None:
    pool = ["nodePools.h200.nodeSelector.accelerator=h200", "leaderWorkerSet.enabled=true"]
    templates = chart_job_templates(repo_root, set_values=pool)
    spec = _spec(controller_kit, {**TWO_NODE_ENGINES, "node_pool": "h200"})
    objects = instantiate_job_templates(templates, template_params("jpool000001", spec))
    (lws,) = _of_kind(place_on_node_pools(objects, spec, templates), "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        assert group[role]["spec"]["nodeSelector"] == {"accelerator": "h200"}, role
        assert "tolerations" not in group[role]["spec"], role  # the pool's placement replaces the chart's
