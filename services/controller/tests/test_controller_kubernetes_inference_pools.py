"""A job's inference pools (judge, teacher) on the Kubernetes backend, against the fake Kubernetes API
(controller_kubernetes_testkit) with the chart's own templates: each pool gets its engine Deployment (its own model,
no weight-sync, its node pool) and a Service the router discovers as `<job>--<name>`; the job is RUNNING only once
their engines are ready; the workers get the pools' router pools; the controller registers each pool with the
session server; deleting the job deletes them; a job without pools gets none; what the release cannot run is a
400 naming the pool's field."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from controller_kubernetes_testkit import FakeKubernetesApi, chart_job_templates, fake_cluster
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from miles.common.errors import InvalidArgumentError
from miles.common.jobspec.job import JobSpec
from miles.common.serve import serve_async
from miles.common.testing.ports import free_port
from miles.controller.api_models import JobView, PoolView
from miles.controller.backends.kubernetes_inference_pools import COMPONENT, POOL_LABEL
from miles.controller.backends.kubernetes_job_spec import chart_problem
from miles.controller.jobs import JobRecord, JobState

pytestmark = pytest.mark.integration  # runs helm

COMPONENT_LABEL = "app.kubernetes.io/component"
H200 = {"nodeSelector": {"miles.dev/pool": "h200"}, "tolerations": [{"key": "h200", "operator": "Exists"}]}
JUDGE = {"name": "judge", "model_path": "/models/judge", "model_family": "qwen3", "kind": "sglang"}


@pytest.fixture(scope="module")
def templates(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    values = tmp_path_factory.mktemp("values") / "node-pools.yaml"
    values.write_text(yaml.safe_dump({"nodePools": {"h200": H200}}))
    return chart_job_templates(Path(request.config.rootpath), [values])


def _spec(controller_kit: Any, pools: list[dict[str, Any]], **changes: Any) -> JobSpec:
    body = controller_kit.job_spec_body(num_steps=3)
    body["resources"] = {
        "engines": {"replicas": 2, "kind": "sglang", "gpus_per_replica": 1},
        "trainer": {"replicas": 1, "gpus_per_replica": 1},
    }
    return JobSpec.model_validate({**body, "inference_pools": pools, **changes})


def _of_pool(api: FakeKubernetesApi, job_id: str, pool: str) -> dict[str, dict[str, Any]]:
    """The pool's objects by kind."""
    objects = [o for o in api.of_job(job_id) if o["metadata"]["labels"].get(POOL_LABEL) == pool]
    return {o["kind"]: o for o in objects}


def _rollout_json(api: FakeKubernetesApi, job_id: str) -> dict[str, Any]:
    (spec_map,) = [o for o in api.of_job(job_id) if o["metadata"]["name"] == f"miles-{job_id}-spec"]
    loaded: dict[str, Any] = json.loads(spec_map["data"]["rollout.json"])
    return loaded


async def test_a_judge_pool_gets_its_engines_and_router_service_and_a_job_without_pools_none(
    templates: dict[str, str], controller_kit: Any
) -> None:
    judge = {**JUDGE, "replicas": 2, "gpus_per_replica": 2, "tp_size": 2, "node_pool": "h200"}
    judge["extra_args"] = ["--context-length", "8192"]
    critic = {**JUDGE, "name": "critic", "model_path": "/models/critic", "gpus_per_replica": 1}
    spec = _spec(controller_kit, [judge, critic])
    async with fake_cluster(templates) as (api, _, backend):
        await backend.check_spec(spec)
        await backend.start("jpool0000001", spec)
        await backend.start("jplain000001", _spec(controller_kit, []))
        assert api.num_validated == len(api.of_job("jpool0000001")) + len(api.of_job("jplain000001"))

        objects = _of_pool(api, "jpool0000001", "judge")
        deployment, service = objects["Deployment"], objects["Service"]
        assert deployment["metadata"]["name"] == service["metadata"]["name"] == "miles-jpool0000001-pool-judge"
        assert deployment["spec"]["replicas"] == 2
        pod = deployment["spec"]["template"]["spec"]
        assert deployment["spec"]["template"]["metadata"]["labels"][COMPONENT_LABEL] == COMPONENT
        (engine,) = pod["containers"]  # no weight-sync sidecar
        assert engine["name"] == "engine" and "weights" not in {v["name"] for v in pod["volumes"]}
        args = engine["args"]
        assert args[args.index("--model-path") + 1] == "/models/judge" and args[args.index("--tp-size") + 1] == "2"
        assert args[-2:] == ["--context-length", "8192"]
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert pod["nodeSelector"] == H200["nodeSelector"] and pod["tolerations"] == H200["tolerations"]
        # The router discovers the Service's EndpointSlices (component engine) as the pool <job>--<name>.
        assert service["metadata"]["labels"][COMPONENT_LABEL] == "engine"
        assert service["metadata"]["labels"]["miles.dev/pool"] == "jpool0000001--judge"
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        # The job's own engine Service does not select the pools' pods.
        (own,) = [o for o in api.of_job("jpool0000001") if o["metadata"]["name"] == "miles-jpool0000001-engine"
                  and o["kind"] == "Service"]  # fmt: skip
        assert own["spec"]["selector"][COMPONENT_LABEL] == "engine"

        # The critic keeps the chart's placement (no node_pool in the spec: the rollout pool for SGLang).
        critic = _of_pool(api, "jpool0000001", "critic")["Deployment"]["spec"]["template"]["spec"]
        assert critic["nodeSelector"] == {"miles.dev/pool": "rollout"}
        rollout = _rollout_json(api, "jpool0000001")
        assert rollout["inference_pools"] == {"judge": "jpool0000001--judge", "critic": "jpool0000001--critic"}
        assert rollout["teacher_pool"] == ""

        plain = api.of_job("jplain000001")
        assert not any(POOL_LABEL in o["metadata"]["labels"] or "-pool-" in o["metadata"]["name"] for o in plain)
        assert "inference_pools" not in _rollout_json(api, "jplain000001")
        assert "inference_engines" not in (await backend.observe("jplain000001", _spec(controller_kit, []))).pools


async def test_the_job_is_running_only_once_its_pools_engines_are_ready_and_stop_deletes_them(
    templates: dict[str, str], controller_kit: Any
) -> None:
    spec = _spec(controller_kit, [{**JUDGE, "gpus_per_replica": 1}])
    async with fake_cluster(templates) as (api, _, backend):
        await backend.start("jpool0000002", spec)
        deployment = _of_pool(api, "jpool0000002", "judge")["Deployment"]
        deployment["status"]["readyReplicas"] = 0  # the judge is still loading its model
        waiting = await backend.observe("jpool0000002", spec)
        assert waiting.phase == "starting" and waiting.pools["inference_engines"] == 0
        deployment["status"]["readyReplicas"] = 1
        ready = await backend.observe("jpool0000002", spec)
        assert ready.phase == "running" and ready.pools["inference_engines"] == 1
        record = JobRecord("jpool0000002", spec, JobState.RUNNING, 0.0, 0.0, pools=ready.pools)
        assert JobView.of(record).pools["inference_engines"] == PoolView(desired=1, live=1)  # GET /v1/jobs/{id}
        plain = JobRecord("jplain000002", _spec(controller_kit, []), JobState.RUNNING, 0.0, 0.0)
        assert "inference_engines" not in JobView.of(plain).pools
        await backend.resize("jpool0000002", spec, engines=4, rollout_workers=None)  # the pool is not resized
        assert _of_pool(api, "jpool0000002", "judge")["Deployment"]["spec"]["replicas"] == 1
        await backend.stop("jpool0000002")
        assert api.of_job("jpool0000002") == []


async def test_a_teachers_router_pool_reaches_the_workers(templates: dict[str, str], controller_kit: Any) -> None:
    teacher = {**JUDGE, "name": "teacher", "gpus_per_replica": 1}
    train = {**controller_kit.job_spec_body()["train"], "distillation": {"teacher_pool": "teacher"}}
    spec = _spec(controller_kit, [teacher], train=train)
    async with fake_cluster(templates) as (api, _, backend):
        await backend.start("jteach000001", spec)
        rollout = _rollout_json(api, "jteach000001")
        assert rollout["teacher_pool"] == "jteach000001--teacher"
        assert rollout["inference_pools"] == {"teacher": "jteach000001--teacher"}


@pytest.mark.parametrize(
    ("pool", "field", "message"),
    [
        ({"kind": "cpu"}, "inference_pools[0].kind", "runs 'sglang' engines"),
        ({"gpus_per_replica": 1, "tp_size": 2}, "inference_pools[0].gpus_per_replica", "tp_size 2"),
        ({"gpus_per_replica": 1, "node_pool": "a100-spot"}, "inference_pools[0].node_pool", "'a100-spot'"),
    ],
)
async def test_a_pool_the_release_cannot_run_is_refused_before_anything_is_created(
    templates: dict[str, str], controller_kit: Any, pool: dict[str, Any], field: str, message: str
) -> None:
    spec = _spec(controller_kit, [{**JUDGE, **pool}])
    async with fake_cluster(templates) as (api, _, backend):
        with pytest.raises(InvalidArgumentError, match=message) as refused:
            await backend.check_spec(spec)
        assert refused.value.field == field
        with pytest.raises(Exception, match=message):
            await backend.start("jbadpool0001", spec)
        assert api.of_job("jbadpool0001") == []


def test_a_chart_without_inference_pool_templates_refuses_pools(templates: dict[str, str], controller_kit: Any) -> None:
    older = {key: text for key, text in templates.items() if not key.startswith("inference-pool-")}
    problem = chart_problem(older, _spec(controller_kit, [{**JUDGE, "gpus_per_replica": 1}]))
    assert problem is not None and problem[0] == "inference_pools" and "older" in problem[1]
    assert chart_problem(older, _spec(controller_kit, [])) is None


@contextlib.asynccontextmanager
async def fake_session_server() -> AsyncIterator[tuple[str, list[tuple[str, str, Any]]]]:
    """A session server that stores job configs: its URL and the (method, job id, body) it was sent."""
    calls: list[tuple[str, str, Any]] = []
    app = FastAPI()

    @app.api_route("/v1/jobs/{job_id}/config", methods=["PUT", "DELETE"])
    async def config(job_id: str, request: Request) -> JSONResponse:
        body = await request.json() if request.method == "PUT" else None
        calls.append((request.method, job_id, body))
        return JSONResponse(body or {})

    stop, port = asyncio.Event(), free_port()
    server = asyncio.create_task(
        serve_async(http_app=app, http_port=port, stop_event=stop, handle_signals=False, grace_s=1.0)
    )
    for _ in range(200):
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", calls
    finally:
        stop.set()
        await server


async def test_the_controller_registers_the_judge_with_the_session_server_and_cleans_up_with_the_job(
    templates: dict[str, str], redis_url: str, controller_kit: Any
) -> None:
    kit = controller_kit
    async with (
        fake_session_server() as (session_url, calls),
        fake_cluster(templates) as (api, _, backend),
        kit.running(kit.make_settings(redis_url, session_url=session_url), backend) as client,
    ):
        body = _spec(kit, [{**JUDGE, "gpus_per_replica": 1, "chat_template_kwargs": {"enable_thinking": False}}])
        created = await client.post("/v1/jobs", json=body.model_dump(mode="json"))
        assert created.status_code == 201, created.text
        job_id = created.json()["job_id"]
        await kit.wait_for_state(client, job_id, "RUNNING")
        registered = {job: body for method, job, body in calls if method == "PUT"}
        assert registered[f"{job_id}--judge"] == {
            "model_path": "/models/judge",
            "model_family": "qwen3",
            "engine_pool": f"{job_id}--judge",
            "chat_template_kwargs": {"enable_thinking": False},
        }
        assert _of_pool(api, job_id, "judge")["Service"]["metadata"]["labels"]["miles.dev/pool"] == f"{job_id}--judge"
        assert (await client.post(f"/v1/jobs/{job_id}/cancel")).status_code < 300
        await kit.wait_for_state(client, job_id, "CANCELLED")
        await kit.wait_until(lambda: api.of_job(job_id) == [])
        assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 204
        await kit.wait_until(lambda: ("DELETE", f"{job_id}--judge", None) in calls)


async def test_a_kueue_job_with_pools_is_refused(templates: dict[str, str], controller_kit: Any) -> None:
    """Kueue's Workload would need a podSet per pool: refused before anything is created."""
    spec = _spec(controller_kit, [{**JUDGE, "gpus_per_replica": 1}], kueue={"queue_name": "team-a"})
    async with fake_cluster(templates) as (api, _, backend):
        with pytest.raises(InvalidArgumentError, match="Kueue") as refused:
            await backend.check_spec(spec)
        assert refused.value.field == "inference_pools"
        assert [method for method, _ in api.requests if method == "POST"] == []
