"""LoRA jobs on a shared engine pool on the Kubernetes backend, against the fake Kubernetes API
(controller_kubernetes_testkit) with the chart's own templates rendered with a `sharedPools` entry: such a job gets no
engines or weight-sync of its own, its trainer publishes adapters into the pool through the volume the pool's
engines read, an undeclared pool is refused before anything is created, and a job with its own engines is
unchanged by the chart declaring pools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from controller_kubernetes_testkit import NAMESPACE, chart_job_templates, fake_cluster

from miles.common.errors import FailedPreconditionError, InvalidArgumentError
from miles.common.jobspec.job import JobSpec
from miles.common.testing.helm import render_chart
from miles.controller.backends.base import SharedPool
from miles.controller.backends.kubernetes_shared_pool import OWN_ENGINE_COMPONENTS
from miles.proto.trainer.v1 import trainer_pb2

pytestmark = pytest.mark.integration  # runs helm

POOL = "qwen-lora"
CHART_POOL = {"name": POOL, "modelPath": "/models/tiny", "replicas": 2, "adapterVolume": "lora-adapters"}
DECLARED = (SharedPool(name=POOL, model_path="/models/tiny", replicas=2),)
COMPONENT = "app.kubernetes.io/component"


@pytest.fixture(scope="module")
def repo_root(request: pytest.FixtureRequest) -> Path:
    return Path(request.config.rootpath)


@pytest.fixture(scope="module")
def pool_values(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("values") / "pools.yaml"
    path.write_text(yaml.safe_dump({"sharedPools": [CHART_POOL]}))
    return path


@pytest.fixture(scope="module")
def pool_templates(repo_root: Path, pool_values: Path) -> dict[str, str]:
    return chart_job_templates(repo_root, [pool_values])


@pytest.fixture(scope="module")
def pool_deployment(repo_root: Path, pool_values: Path) -> dict[str, Any]:
    """The pool's engine Deployment as the chart renders it (the release creates it, not the controller)."""
    objects = render_chart(repo_root / "helm" / "miles", [pool_values], namespace=NAMESPACE)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == f"miles-pool-{POOL}"]
    return deployment


def _lora_spec(controller_kit: Any, engines: dict[str, Any]) -> JobSpec:
    body = controller_kit.job_spec_body(num_steps=3)
    body["train"] = {**body["train"], "lora": {"rank": 8}}
    body["resources"] = {"engines": engines, "rollout_workers": {"replicas": 1}, "trainer": {"replicas": 1}}
    return JobSpec.model_validate(body)


def _trainer_container(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    (trainer,) = [o for o in objects if o["kind"] == "StatefulSet"]
    (container,) = trainer["spec"]["template"]["spec"]["containers"]
    return trainer, container


def _load_trainer_settings(container: dict[str, Any], trainer_json: str, tmp_path: Path, monkeypatch: Any) -> Any:
    """The settings a trainer pod loads: its env (Secret values stood in for) plus trainer.json of the spec."""
    from miles.common.settings import load_settings
    from miles.trainer.settings import TrainerSettings

    for env in container["env"]:
        if env["name"].startswith("MILES_TRAINER_") and "value" in env:
            monkeypatch.setenv(env["name"], env["value"])
        elif env["name"].startswith("MILES_TRAINER_") and "secretKeyRef" in env.get("valueFrom", {}):
            monkeypatch.setenv(env["name"], f"secret-{env['valueFrom']['secretKeyRef']['key']}".ljust(40, "x"))
    config = tmp_path / "trainer.json"
    config.write_text(trainer_json)
    monkeypatch.setenv("MILES_TRAINER_CONFIG_FILE", str(config))
    monkeypatch.setenv("MILES_TRAINER_RANK", "0")
    return load_settings(TrainerSettings)


async def test_a_job_on_a_shared_pool_gets_no_engines_and_its_trainer_publishes_adapters_into_the_pool(
    pool_templates: dict[str, str],
    pool_deployment: dict[str, Any],
    controller_kit: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = _lora_spec(controller_kit, {"shared_pool": POOL})  # engines.kind stays cpu: the chart runs sglang
    async with fake_cluster(pool_templates, shared_pools=DECLARED) as (api, trainer_status, backend):
        await backend.check_spec(spec)
        await backend.start("jk8slora001", spec)
        created = api.of_job("jk8slora001")
        # The pool's engines are the platform's: observe reports them and does not wait for them.
        trainer_status.state = trainer_pb2.TRAINER_STATE_STARTING
        progress = await backend.observe("jk8slora001", spec)
        assert progress.phase == "running" and progress.pools == {"engines": 0, "rollout_workers": 1, "trainer": 1}
        api.add("apis/apps/v1", "deployments", {**pool_deployment, "status": {"readyReplicas": 2}})
        assert (await backend.observe("jk8slora001", spec)).pools["engines"] == 2

    assert api.num_validated == len(created)  # every object passed strict validation
    components = {o["metadata"]["labels"][COMPONENT] for o in created}
    assert components == {"job-spec", "rollout-worker", "trainer"}
    assert not components & OWN_ENGINE_COMPONENTS
    trainer, container = _trainer_container(created)
    (owner,) = [o for o in created if o["kind"] == "ConfigMap"]
    assert trainer["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]

    # The adapter volume: the trainer writes <mount>/<job>/adapter-v* into the claim's <job> directory, which the
    # pool's engines read at the same path (they mount the whole claim at the mount path).
    volumes = {v["name"]: v for v in trainer["spec"]["template"]["spec"]["volumes"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "shared-pool-adapters")
    assert mount == {"name": "shared-pool-adapters", "mountPath": "/adapters/jk8slora001", "subPath": "jk8slora001"}
    engine_pod = pool_deployment["spec"]["template"]["spec"]
    engine_volume = next(v for v in engine_pod["volumes"] if v["name"] == "adapters")
    engine_mount = next(m for m in engine_pod["containers"][0]["volumeMounts"] if m["name"] == "adapters")
    claim = volumes["shared-pool-adapters"]["persistentVolumeClaim"]["claimName"]
    assert claim == engine_volume["persistentVolumeClaim"]["claimName"] == "lora-adapters"
    assert f"{engine_mount['mountPath']}/{mount['subPath']}" == mount["mountPath"]
    assert engine_mount["readOnly"] is True and "readOnly" not in mount

    settings = _load_trainer_settings(container, owner["data"]["trainer.json"], tmp_path, monkeypatch)
    publish = settings.publish
    assert (publish.kind, publish.pool, publish.dir) == ("adapter", POOL, Path("/adapters/jk8slora001"))
    assert publish.router_url.startswith("http://miles-rollout-router:")
    assert publish.session_url == "http://session:8081"  # the controller's session_url
    assert publish.weightsync_address == ""  # no origin of its own
    assert settings.session_operator_token.get_secret_value().startswith("secret-session-operator-token")
    token = next(e for e in container["env"] if e["name"] == "MILES_TRAINER_SESSION_OPERATOR_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "miles-auth", "key": "session-operator-token"}


async def test_a_pool_the_controller_or_the_chart_does_not_declare_is_refused_before_anything_is_created(
    repo_root: Path, pool_templates: dict[str, str], controller_kit: Any
) -> None:
    spec = _lora_spec(controller_kit, {"shared_pool": POOL})
    chart_without_pools = chart_job_templates(repo_root)
    for templates, declared in ((pool_templates, ()), (chart_without_pools, DECLARED)):
        async with fake_cluster(templates, shared_pools=declared) as (api, _, backend):
            with pytest.raises(InvalidArgumentError, match=f"shared engine pool '{POOL}'") as refused:
                await backend.check_spec(spec)
            assert refused.value.field == "resources.engines.shared_pool"
            # A pool gone since submission (settings or chart changed) fails the start for good.
            with pytest.raises(FailedPreconditionError, match="no longer declared"):
                await backend.start("jk8slora002", spec)
            assert api.of_job("jk8slora002") == []


async def test_a_job_with_its_own_engines_is_unchanged_by_the_chart_declaring_shared_pools(
    repo_root: Path, pool_templates: dict[str, str], controller_kit: Any
) -> None:
    spec = _lora_spec(controller_kit, {"replicas": 2, "kind": "sglang", "gpus_per_replica": 1})
    created = []
    for templates in (chart_job_templates(repo_root), pool_templates):
        async with fake_cluster(templates, shared_pools=DECLARED) as (api, _, backend):
            await backend.start("jk8slora003", spec)
            created.append(api.of_job("jk8slora003"))

    def comparable(objects: list[dict[str, Any]]) -> list[str]:
        assigned = {"uid", "resourceVersion", "namespace", "ownerReferences"}  # by the API server, per object
        stripped = [{**o, "metadata": {k: v for k, v in o["metadata"].items() if k not in assigned}} for o in objects]
        return sorted(json.dumps(o, sort_keys=True) for o in stripped)

    without_pools, with_pools = created
    assert comparable(with_pools) == comparable(without_pools)
    assert {o["metadata"]["labels"][COMPONENT] for o in with_pools} >= {"engine", "weight-sync-origin"}
    _, container = _trainer_container(with_pools)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MILES_TRAINER_PUBLISH__POOL"] == "jk8slora003"
    assert "MILES_TRAINER_SESSION_OPERATOR_TOKEN" not in env
