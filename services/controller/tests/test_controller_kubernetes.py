"""The Kubernetes backend with the official client against a fake Kubernetes API (controller_kubernetes_testkit:
no cluster here), with the chart's own templates rendered with helm.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from controller_kubernetes_testkit import KUBERNETES_VERSION, NAMESPACE, TEMPLATES, fake_cluster

from miles.common.auth import SANDBOX_CAPABILITY, job_capability
from miles.common.errors import FailedPreconditionError, InvalidArgumentError
from miles.common.jobspec.job import JobSpec
from miles.common.jobspec.rollout import RolloutSpec
from miles.common.jobspec.trainer import TrainConfig
from miles.common.testing.helm import render_chart
from miles.controller.backends.base import PlatformTokens
from miles.controller.job_templates import engine_kind_of
from miles.proto.trainer.v1 import trainer_pb2

pytestmark = pytest.mark.integration
ROUTING_FLAG = "--enable-return-routed-experts"


@pytest.fixture(scope="module")
def job_templates(repo_root_module: Path) -> dict[str, str]:
    objects = render_chart(repo_root_module / "helm" / "miles", namespace=NAMESPACE)
    (config_map,) = [obj for obj in objects if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == TEMPLATES]
    return dict(config_map["data"])


@pytest.fixture(scope="module")
def repo_root_module(request: pytest.FixtureRequest) -> Path:
    return Path(request.config.rootpath)


def _spec(controller_kit: Any, **changes: Any) -> JobSpec:
    body = controller_kit.job_spec_body(num_steps=3)
    body["resources"] = {
        "engines": {"replicas": 2, "kind": "sglang", "gpus_per_replica": 1},
        "rollout_workers": {"replicas": 2},
        "trainer": {"replicas": 1, "gpus_per_replica": 1},
    }
    body.update(changes)
    return JobSpec.model_validate(body)


async def test_start_creates_valid_objects_owned_by_the_spec_config_map_and_adopts_on_restart(
    job_templates: dict[str, str], controller_kit: Any
) -> None:
    async with fake_cluster(job_templates) as (api, _, backend):
        spec = _spec(controller_kit)
        await backend.start("jk8s0000001", spec)
        created = api.of_job("jk8s0000001")
        kinds = sorted(obj["kind"] for obj in created)
        assert kinds.count("Deployment") >= 3 and "StatefulSet" in kinds and "ConfigMap" in kinds
        posts = [path for method, path in api.requests if method == "POST"]
        assert posts[0].endswith("/configmaps")  # the owner first
        (owner,) = [obj for obj in created if obj["kind"] == "ConfigMap"]
        assert owner["metadata"]["name"] == "miles-jk8s0000001-spec"
        for obj in created:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            if obj is not owner:
                refs = obj["metadata"]["ownerReferences"]
                assert [(ref["kind"], ref["name"], ref["uid"]) for ref in refs] == [
                    ("ConfigMap", owner["metadata"]["name"], owner["metadata"]["uid"])
                ]
        assert api.num_validated == len(created)
        assert json.dumps(created).count("${") == 0
        data = owner["data"]
        assert RolloutSpec.model_validate(json.loads(data["rollout.json"])["rollout"]) == spec.rollout
        assert TrainConfig.model_validate(json.loads(data["trainer.json"])["train"]).num_steps == 3
        assert JobSpec.model_validate(json.loads(data["spec.json"])) == spec
        (engine,) = [
            obj
            for obj in created
            if obj["kind"] == "Deployment" and obj["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
        ]
        assert engine["spec"]["replicas"] == 2

        await backend.start("jk8s0000001", spec)  # a restarted controller adopts: nothing new, nothing fails
        assert sorted(obj["metadata"]["uid"] for obj in api.of_job("jk8s0000001")) == sorted(
            obj["metadata"]["uid"] for obj in created
        )


async def test_each_job_gets_its_own_sandbox_capability_and_the_trainer_is_called_with_its_token(
    job_templates: dict[str, str], controller_kit: Any
) -> None:
    tokens = PlatformTokens(sandbox_operator="s" * 40, trainer="t" * 40)
    async with fake_cluster(job_templates, tokens) as (api, trainer, backend):
        spec = _spec(controller_kit)
        for job_id in ("jk8stok0001", "jk8stok0002"):
            await backend.start(job_id, spec)
        await backend.observe("jk8stok0001", spec)
        capabilities = {}
        for job_id in ("jk8stok0001", "jk8stok0002"):
            (secret,) = [obj for obj in api.of_job(job_id) if obj["kind"] == "Secret"]
            assert secret["metadata"]["name"] == f"miles-{job_id}-tokens"
            capabilities[job_id] = secret["stringData"]["sandbox-token"]
            assert capabilities[job_id] == job_capability("s" * 40, SANDBOX_CAPABILITY, job_id)
            (workers,) = [
                obj
                for obj in api.of_job(job_id)
                if obj["kind"] == "Deployment"
                and obj["metadata"]["labels"]["app.kubernetes.io/component"] == "rollout-worker"
            ]
            env = {item["name"]: item for item in workers["spec"]["template"]["spec"]["containers"][0]["env"]}
            assert env["MILES_ROLLOUT_SANDBOX_TOKEN"]["valueFrom"]["secretKeyRef"] == {
                "name": f"miles-{job_id}-tokens",
                "key": "sandbox-token",
            }
        assert capabilities["jk8stok0001"] != capabilities["jk8stok0002"]
        assert trainer.authorization == [f"Bearer {'t' * 40}"]


async def test_observe_reads_pools_and_the_trainer_status(job_templates: dict[str, str], controller_kit: Any) -> None:
    async with fake_cluster(job_templates) as (_, trainer, backend):
        spec = _spec(controller_kit)
        await backend.start("jk8s0000002", spec)
        trainer.step = 1
        progress = await backend.observe("jk8s0000002", spec)
        assert progress.phase == "running" and progress.step == 1 and progress.weight_version == 1
        assert progress.pools == {"engines": 2, "rollout_workers": 2, "trainer": 1}
        assert progress.metrics["reward_mean"] == 0.5
        trainer.state, trainer.step = trainer_pb2.TRAINER_STATE_FINISHED, 3
        assert (await backend.observe("jk8s0000002", spec)).phase == "succeeded"
        trainer.state, trainer.error = trainer_pb2.TRAINER_STATE_FAILED, "CUDA out of memory"
        failed = await backend.observe("jk8s0000002", spec)
        assert failed.phase == "failed" and "CUDA out of memory" in failed.error


async def test_resize_patches_replicas_and_stop_deletes_every_object_of_that_job_only(
    job_templates: dict[str, str], controller_kit: Any
) -> None:
    async with fake_cluster(job_templates) as (api, _, backend):
        spec = _spec(controller_kit)
        await backend.start("jk8s0000003", spec)
        await backend.start("jk8s0000004", spec)
        await backend.resize("jk8s0000003", spec, engines=4, rollout_workers=1)
        progress = await backend.observe("jk8s0000003", spec)
        assert progress.pools["engines"] == 4 and progress.pools["rollout_workers"] == 1
        assert (await backend.observe("jk8s0000004", spec)).pools["engines"] == 2
        other_job = sorted(obj["metadata"]["uid"] for obj in api.of_job("jk8s0000004"))
        await backend.stop("jk8s0000003")
        assert api.of_job("jk8s0000003") == []
        assert sorted(obj["metadata"]["uid"] for obj in api.of_job("jk8s0000004")) == other_job
        await backend.stop("jk8s0000003")  # idempotent
        gone = await backend.observe("jk8s0000003", spec)
        assert gone.phase == "failed" and "was deleted" in gone.error


async def test_missing_templates_is_a_clear_non_retryable_error(controller_kit: Any) -> None:
    async with fake_cluster(None) as (_, _, backend):
        with pytest.raises(FailedPreconditionError, match="job templates"):
            await backend.start("jk8s0000005", _spec(controller_kit))


async def test_a_job_asking_for_the_engine_kind_the_chart_does_not_run_is_refused_before_creating_anything(
    job_templates: dict[str, str], controller_kit: Any
) -> None:
    assert engine_kind_of(job_templates) == "sglang"  # the chart's default
    spec = _spec(controller_kit)
    cpu_engines = spec.model_copy(
        update={
            "resources": spec.resources.model_copy(
                update={"engines": spec.resources.engines.model_copy(update={"kind": "cpu", "gpus_per_replica": 0})}
            )
        }
    )
    async with fake_cluster(job_templates) as (api, _, backend):
        with pytest.raises(FailedPreconditionError, match=r"engines\.kind='cpu'.*runs 'sglang' engines"):
            await backend.start("jk8s0000007", cpu_engines)
        assert api.of_job("jk8s0000007") == []
        await backend.start("jk8s0000008", spec)  # the kind the chart runs is accepted
        assert api.of_job("jk8s0000008")


async def test_the_trainer_pod_publishes_to_the_jobs_origin_with_the_spec_transport(
    job_templates: dict[str, str], controller_kit: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seam controller -> chart -> trainer: the settings a trainer pod loads (its env from the template plus
    trainer.json of the spec ConfigMap) publish each version to the job's own weight-sync origin Service (stream),
    or into the job's engine pool through the shared router (nccl); disk is refused before anything is created."""
    from miles.common.settings import load_settings
    from miles.trainer.settings import TrainerSettings

    for job_id, transport in (("jk8s0000011", "stream"), ("jk8s0000012", "nccl")):
        spec = _spec(controller_kit, weight_sync={"transport": transport, "pause_mode": "retract"})
        async with fake_cluster(job_templates) as (api, _, backend):
            await backend.start(job_id, spec)
            created = api.of_job(job_id)
        (owner,) = [o for o in created if o["kind"] == "ConfigMap"]
        (trainer,) = [o for o in created if o["kind"] == "StatefulSet"]
        (origin,) = [o for o in created if o["kind"] == "Service" and o["metadata"]["name"].endswith("-origin")]
        config = tmp_path / f"{job_id}.json"
        config.write_text(owner["data"]["trainer.json"])
        for env in trainer["spec"]["template"]["spec"]["containers"][0]["env"]:
            if env["name"].startswith("MILES_TRAINER_") and "value" in env:
                monkeypatch.setenv(env["name"], env["value"])
            elif env["name"].startswith("MILES_TRAINER_") and "secretKeyRef" in env.get("valueFrom", {}):
                monkeypatch.setenv(env["name"], f"secret-{env['valueFrom']['secretKeyRef']['key']}".ljust(40, "x"))
        monkeypatch.setenv("MILES_TRAINER_CONFIG_FILE", str(config))
        monkeypatch.setenv("MILES_TRAINER_RANK", "0")
        publish = load_settings(TrainerSettings).publish
        assert (publish.kind, publish.dtype, publish.pause_mode) == (transport, "bfloat16", "retract")
        origin_port = next(p["port"] for p in origin["spec"]["ports"] if p["name"] == "grpc")
        assert publish.weightsync_address == f"{origin['metadata']['name']}:{origin_port}"
        assert publish.pool == job_id and publish.router_url.startswith("http://")
    disk = _spec(controller_kit, weight_sync={"transport": "disk"})
    async with fake_cluster(job_templates) as (api, _, backend):
        with pytest.raises(InvalidArgumentError, match="share") as refused:
            await backend.check_spec(disk)
        assert refused.value.field == "weight_sync.transport"
        with pytest.raises(InvalidArgumentError):
            await backend.start("jk8s0000013", disk)
        assert api.of_job("jk8s0000013") == []


async def test_a_judge_pool_of_an_engine_kind_the_chart_does_not_run_is_refused_before_anything_is_created(
    job_templates: dict[str, str], controller_kit: Any
) -> None:
    """The chart renders one engine image (pools it can run: test_controller_kubernetes_inference_pools.py)."""
    judged = _spec(controller_kit, inference_pools=[{"name": "judge", "model_path": "/models/judge", "kind": "cpu"}])
    async with fake_cluster(job_templates) as (api, _, backend):
        with pytest.raises(InvalidArgumentError, match="runs 'sglang' engines") as refused:
            await backend.check_spec(judged)
        assert refused.value.field == "inference_pools[0].kind"
        with pytest.raises(FailedPreconditionError):  # the chart may change after submission
            await backend.start("jk8spool002", judged)
        assert api.of_job("jk8spool002") == []


async def test_an_object_the_api_refuses_is_a_non_retryable_error(
    job_templates: dict[str, str], controller_kit: Any
) -> None:
    broken = dict(job_templates)
    broken["zz-broken.yaml"] = (
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: miles-${JOB_ID}-broken\n"
        "  labels: {miles.dev/job: ${JOB_ID}}\nspec:\n  bogusField: 1\n"
    )
    async with fake_cluster(broken) as (api, _, backend):
        with pytest.raises(FailedPreconditionError, match="bogusField"):
            await backend.start("jk8s0000006", _spec(controller_kit))
        assert not any(obj["metadata"]["name"].endswith("-broken") for obj in api.of_job("jk8s0000006"))


@pytest.mark.parametrize(
    ("kind", "record_routing", "chart_args", "num_flags"),
    [
        ("sglang", True, [], 1),
        ("sglang", False, [], 0),
        ("sglang", None, [], 0),
        ("sglang", True, [ROUTING_FLAG], 1),
        ("cpu", True, [], 1),
        ("cpu", False, [], 0),
    ],
    ids=["moe", "dense", "unresolved", "chart-names-it", "cpu-moe", "cpu-dense"],
)
async def test_engines_of_a_job_that_records_routing_get_the_flag_once(
    repo_root_module: Path,
    controller_kit: Any,
    kind: str,
    record_routing: bool | None,
    chart_args: list[str],
    num_flags: int,
) -> None:
    """`record_routing` is the session server's answer at registration (the controller cannot read /models/tiny):
    a MoE job's engine container runs with the flag exactly once, a dense job's without; the chart's extraArgs
    naming it are not doubled."""
    set_values = [f"jobTemplates.engine.kind={kind}"]
    set_values += [f"jobTemplates.engine.{kind}.extraArgs[{i}]={arg}" for i, arg in enumerate(chart_args)]
    objects = render_chart(repo_root_module / "helm" / "miles", set_values=set_values, namespace=NAMESPACE)
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == TEMPLATES]
    engines = {"replicas": 1, "kind": kind, "gpus_per_replica": 1 if kind == "sglang" else 0}
    spec = _spec(controller_kit, resources={"engines": engines})
    async with fake_cluster(dict(config_map["data"])) as (api, _, backend):
        await backend.start("jk8sr3" + kind, spec, record_routing=record_routing)
        (engine,) = [
            o
            for o in api.of_job("jk8sr3" + kind)
            if o["kind"] == "Deployment" and o["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
        ]
    containers = {c["name"]: c for c in engine["spec"]["template"]["spec"]["containers"]}
    assert containers["engine"]["args"].count(ROUTING_FLAG) == num_flags
    assert all(ROUTING_FLAG not in c.get("args", []) for name, c in containers.items() if name != "engine")


async def test_controller_runs_a_job_to_success_on_the_kubernetes_backend(
    job_templates: dict[str, str], redis_url: str, controller_kit: Any
) -> None:
    kit = controller_kit
    async with (
        fake_cluster(job_templates) as (api, trainer, backend),
        kit.running(kit.make_settings(redis_url), backend) as client,
    ):
        body = kit.job_spec_body(num_steps=3)
        refused = await client.post("/v1/jobs", json=body)  # cpu engines; the chart runs SGLang
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["field"] == "resources.engines.kind"
        assert (await client.get("/v1/jobs")).json()["jobs"] == []
        body["resources"] = {"engines": {"replicas": 2, "kind": "sglang", "gpus_per_replica": 1}}
        job_id = (await client.post("/v1/jobs", json=body)).json()["job_id"]
        await kit.wait_for_state(client, job_id, "RUNNING")
        assert api.of_job(job_id)
        response = await client.patch(f"/v1/jobs/{job_id}", json={"engines": 3})
        assert response.status_code == 202
        await kit.wait_until(
            lambda: any(obj["kind"] == "Deployment" and obj["spec"]["replicas"] == 3 for obj in api.of_job(job_id))
        )
        trainer.state, trainer.step = trainer_pb2.TRAINER_STATE_FINISHED, 3
        job = await kit.wait_for_state(client, job_id, "SUCCEEDED", "FAILED")
        assert job["state"] == "SUCCEEDED" and job["step"] == 3 and job["reward"] == 0.5
        assert api.of_job(job_id) == []


ENV_ROLLOUT = {
    "environment": {"connector": "reasoning_gym", "args": {"dataset": "leg_counting", "size": 20}, "replicas": 2},
    "n_samples_per_prompt": 4,
}


def _of_component(objects: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == component]


async def test_a_job_with_an_environment_gets_its_server_and_its_workers_its_url_and_one_without_gets_none(
    job_templates: dict[str, str], controller_kit: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollout.environment: the env-server Deployment, Service and ingress NetworkPolicy are created (valid, owned
    by the spec ConfigMap) and the workers load MILES_ROLLOUT_ENVIRONMENT_URL = that Service; a job without one
    gets no env-server object; a connector the chart has no image for is refused before anything is created."""
    from miles.common.settings import load_settings
    from miles.rollout.settings import RolloutSettings

    async with fake_cluster(job_templates) as (api, _, backend):
        spec = _spec(controller_kit, rollout=ENV_ROLLOUT)
        await backend.check_spec(spec)
        await backend.start("jk8senv0001", spec)
        created = api.of_job("jk8senv0001")
        await backend.start("jk8senv0002", _spec(controller_kit))
        without = api.of_job("jk8senv0002")
        custom = _spec(controller_kit, rollout={**ENV_ROLLOUT, "environment": {"connector": "my_pkg.my_env"}})
        with pytest.raises(InvalidArgumentError) as refused:
            await backend.check_spec(custom)
        assert refused.value.field == "rollout.environment.connector"
        with pytest.raises(InvalidArgumentError, match=r"no environment-server image for connector 'my_pkg\.my_env'"):
            await backend.start("jk8senv0003", custom)
        assert api.of_job("jk8senv0003") == []
        for field, value in (("interpreter", "/usr/bin/python3"), ("python_path", ["examples"])):
            local_only = {**ENV_ROLLOUT, "environment": {**ENV_ROLLOUT["environment"], field: value}}
            with pytest.raises(InvalidArgumentError, match="local environment servers only") as refused:
                await backend.check_spec(_spec(controller_kit, rollout=local_only))
            assert refused.value.field == f"rollout.environment.{field}"
        assert (await backend.observe("jk8senv0001", spec)).pools == {"engines": 2, "rollout_workers": 2, "trainer": 1}

    assert api.num_validated == len(created) + len(without)  # every object passed strict validation
    env_objects = {(o["kind"], o["metadata"]["name"]) for o in _of_component(created, "env-server")}
    assert env_objects == {
        ("Deployment", "miles-jk8senv0001-env-server"),
        ("Service", "miles-jk8senv0001-env-server"),
        ("NetworkPolicy", "miles-jk8senv0001-env-server-ingress"),
    }
    (owner,) = [o for o in created if o["kind"] == "ConfigMap"]
    assert all(
        o["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"] for o in created if o is not owner
    )
    (server,) = [o for o in _of_component(created, "env-server") if o["kind"] == "Deployment"]
    (service,) = [o for o in _of_component(created, "env-server") if o["kind"] == "Service"]
    assert server["spec"]["replicas"] == 2
    (container,) = server["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/miles-rl/miles-envserver-reasoning-gym:0.1.0"
    assert container["args"][:3] == ["--connector", "reasoning_gym", "--args"]
    assert json.loads(container["args"][3]) == {"dataset": "leg_counting", "size": 20}
    assert service["spec"]["selector"].items() <= server["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]

    # The seam controller -> chart -> worker: what a worker pod loads (its env plus rollout.json).
    (workers,) = [o for o in _of_component(created, "rollout-worker") if o["kind"] == "Deployment"]
    config = tmp_path / "rollout.json"
    config.write_text(owner["data"]["rollout.json"])
    for env in workers["spec"]["template"]["spec"]["containers"][0]["env"]:
        if env["name"].startswith("MILES_ROLLOUT_") and "value" in env:
            monkeypatch.setenv(env["name"], env["value"])
    monkeypatch.setenv("MILES_ROLLOUT_CONFIG_FILE", str(config))
    settings = load_settings(RolloutSettings)
    assert settings.environment_url == f"http://{service['metadata']['name']}:{port['port']}"
    assert settings.rollout is not None and settings.rollout.environment is not None
    assert settings.rollout.environment.connector == "reasoning_gym"

    assert _of_component(without, "env-server") == []
    (plain_workers,) = [o for o in _of_component(without, "rollout-worker") if o["kind"] == "Deployment"]
    assert "MILES_ROLLOUT_ENVIRONMENT_URL" not in {
        e["name"] for e in plain_workers["spec"]["template"]["spec"]["containers"][0]["env"]
    }


async def test_workers_of_a_sync_job_load_the_barrier_and_the_routers_url(
    job_templates: dict[str, str], controller_kit: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.mode sync: the seam controller -> chart -> worker gives the barrier its batch size, the equal-reward
    rule of the trainer's dynamic sampling and the router to read the version from; an async job gets the staleness
    window (its batch size, max_staleness versions ahead)."""
    from miles.common.settings import load_settings
    from miles.rollout.settings import RolloutSettings

    def worker_settings(objects: list[dict[str, Any]], name: str) -> RolloutSettings:
        (owner,) = [o for o in objects if o["kind"] == "ConfigMap"]
        (workers,) = [o for o in _of_component(objects, "rollout-worker") if o["kind"] == "Deployment"]
        config = tmp_path / f"{name}.json"
        config.write_text(owner["data"]["rollout.json"])
        for env in workers["spec"]["template"]["spec"]["containers"][0]["env"]:
            if env["name"].startswith("MILES_ROLLOUT_") and "value" in env:
                monkeypatch.setenv(env["name"], env["value"])
        monkeypatch.setenv("MILES_ROLLOUT_CONFIG_FILE", str(config))
        return load_settings(RolloutSettings)

    async with fake_cluster(job_templates) as (api, _, backend):
        sync_spec = _spec(controller_kit, train={"mode": "sync", "batch_size_groups": 3, "num_steps": 3})
        await backend.start("jk8ssync0001", sync_spec)
        await backend.start("jk8ssync0002", _spec(controller_kit))
        synced = worker_settings(api.of_job("jk8ssync0001"), "sync")
        assert (synced.sync_batch_groups, synced.sync_drop_equal_rewards) == (3, True)
        assert synced.admission_versions_ahead == 0
        assert synced.router_url.startswith("http://") and synced.sync_pool == ""
        unsynced = worker_settings(api.of_job("jk8ssync0002"), "async")
        spec = _spec(controller_kit)
        assert (unsynced.sync_batch_groups, unsynced.admission_versions_ahead) == (
            spec.train.batch_size_groups,
            spec.train.max_staleness,
        )
