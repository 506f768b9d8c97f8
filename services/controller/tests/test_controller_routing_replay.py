"""Routing replay (R3) at the controller: `train.routing_replay` true with a model the controller can read as dense
is a 422 naming the field at submission; the flag reaches the trainer's config file (local and Kubernetes), the
session server's job config (`record_routing`, omitted when unset), whose answer `register` returns, and the local
engines' command line (the Kubernetes engines' args: test_controller_kubernetes.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.errors import UnprocessableError
from miles.common.jobspec.job import JobSpec
from miles.common.jobspec.trainer import TrainConfig
from miles.controller.backends import local_layout
from miles.controller.backends.base import PlatformTokens, SharedServices
from miles.controller.backends.kubernetes_job_spec import spec_files
from miles.controller.backends.local import LocalJobBackend
from miles.controller.errors import RoutingReplayNeedsMoEError
from miles.controller.routing_replay import ENGINE_ROUTING_FLAG, check_routing_replay, read_model_routing
from miles.controller.shared import SharedServicesClient

DENSE_CONFIG = {"model_type": "qwen3", "vocab_size": 151936, "num_hidden_layers": 2}
MOE_CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "num_hidden_layers": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
}
REPLAY_VALUES = [True, False, None]


def write_model(root: Path, name: str, config: dict[str, Any] | str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


def spec_for(model: Path | str, replay: bool | None, **resources: Any) -> JobSpec:
    train: dict[str, Any] = {"num_steps": 2}
    if replay is not None:
        train["routing_replay"] = replay
    return JobSpec.model_validate(
        {
            "model": {"path": str(model)},
            "rollout": {"dataset": {"path": "d.jsonl"}, "agent": {"function": "a:agent"}},
            "train": train,
            "resources": resources,
        }
    )


def test_model_routing_reads_dense_moe_and_leaves_unknown_models_alone(tmp_path: Path) -> None:
    moe = read_model_routing(str(write_model(tmp_path, "moe", MOE_CONFIG)))
    assert moe.is_moe and moe.shape is not None
    assert (moe.shape.num_layers, moe.shape.top_k) == (3, 2)  # layer 0 is in mlp_only_layers
    assert read_model_routing(str(write_model(tmp_path, "dense", DENSE_CONFIG))).is_dense
    mixtral = {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2}
    unknown = [
        "Qwen/Qwen3-30B-A3B",  # a Hub id
        str(tmp_path / "absent"),
        str(write_model(tmp_path, "broken", "{not json")),
        str(write_model(tmp_path, "list", "[1, 2]")),
        str(write_model(tmp_path, "mixtral", mixtral)),  # MoE the shape reader does not model: not called dense
        str(write_model(tmp_path, "truncated-moe", {"model_type": "qwen3_moe", "num_experts": 8})),
    ]
    for path in unknown:
        routing = read_model_routing(path)
        assert not routing.known and not routing.is_dense and not routing.is_moe, path


def test_replay_true_with_a_dense_model_is_refused_and_everything_else_passes(tmp_path: Path) -> None:
    dense = write_model(tmp_path, "dense", DENSE_CONFIG)
    with pytest.raises(RoutingReplayNeedsMoEError) as refused:
        check_routing_replay(spec_for(dense, True), read_model_routing(str(dense)))
    assert isinstance(refused.value, UnprocessableError) and refused.value.http_status == 422
    assert refused.value.field == "train.routing_replay"
    assert refused.value.code == "routing_replay_needs_moe"
    assert str(dense) in refused.value.message and "dense" in refused.value.message
    moe = write_model(tmp_path, "moe", MOE_CONFIG)
    for model, replay in [(dense, None), (dense, False), (moe, True), (moe, None), (tmp_path / "absent", True)]:
        check_routing_replay(spec_for(model, replay), read_model_routing(str(model)))


@pytest.mark.parametrize("replay", REPLAY_VALUES, ids=["true", "false", "unset"])
async def test_session_job_config_carries_record_routing_only_when_set(replay: bool | None) -> None:
    bodies: list[dict[str, Any]] = []

    def session_server(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={})

    shared = SharedServices("redis://r", "", "", "http://session.test", "operator", "", "", "")
    client = SharedServicesClient(shared, timeout_s=5.0)
    await client._http.aclose()
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(session_server))
    try:
        await client.register("job-1", spec_for("/models/m", replay))
    finally:
        await client.close()
    (body,) = bodies
    assert body["engine_pool"] == "job-1" and body["model_path"] == "/models/m"
    if replay is None:
        assert "record_routing" not in body  # the session server decides from the model
    else:
        assert body["record_routing"] is replay


@pytest.mark.parametrize(
    ("answer", "returned"),
    [({"record_routing": True}, True), ({"record_routing": False}, False), ({}, None), (None, None)],
    ids=["recorded", "not-recorded", "older-session-server", "no-session-server"],
)
async def test_register_returns_the_record_routing_the_session_server_resolved(
    answer: dict[str, Any] | None, returned: bool | None
) -> None:
    """The PUT's answer is the stored config: its record_routing is what the engines follow (None: unknown)."""

    def session_server(request: httpx.Request) -> httpx.Response:
        assert request.method == "PUT" and "record_routing" not in json.loads(request.content)  # unset in the spec
        return httpx.Response(200, json={"model_path": "/models/m", **(answer or {})})

    session_url = "" if answer is None else "http://session.test"
    client = SharedServicesClient(SharedServices("redis://r", "", "", session_url, "op", "", "", ""), timeout_s=5.0)
    await client._http.aclose()
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(session_server))
    try:
        assert await client.register("job-1", spec_for("/models/m", None)) is returned
    finally:
        await client.close()


@pytest.mark.parametrize("replay", REPLAY_VALUES, ids=["true", "false", "unset"])
def test_trainer_config_files_carry_routing_replay(tmp_path: Path, replay: bool | None) -> None:
    spec = spec_for("/models/m", replay)
    shared = SharedServices("redis://r", "http://127.0.0.1:1", "", "", "", "127.0.0.1:2", "", "")
    record = local_layout.trainer_record(tmp_path, "job-1", spec, shared, "127.0.0.1:3")
    local_train = json.loads(Path(record.env["MILES_TRAINER_CONFIG_FILE"]).read_text())["train"]
    kubernetes_train = spec_files(spec)["trainer.json"]["train"]
    for train in (local_train, kubernetes_train):
        assert train["routing_replay"] is replay
        assert TrainConfig.model_validate(train).routing_replay is replay


@pytest.mark.parametrize(
    ("model", "replay", "resolved", "extra_args", "flagged"),
    [
        ("moe", None, None, [], True),
        ("moe", True, None, [], True),
        ("moe", False, None, [], False),
        ("dense", None, None, [], False),
        ("absent", True, None, [], True),  # unreadable here: the engine itself refuses a dense model
        ("moe", None, None, ["--no-enable-return-routed-experts"], False),
        ("dense", None, None, [ENGINE_ROUTING_FLAG], True),
        ("absent", None, True, [], True),  # the session server read a MoE config.json this process cannot
        ("absent", None, False, [], False),
        ("absent", None, None, [], False),  # nobody could say: no flag (the engine would refuse it for dense)
        ("dense", None, True, [], False),  # what this process reads itself decides, as before
        ("absent", False, True, [], False),  # the spec's choice first
        ("absent", None, True, ["--no-enable-return-routed-experts"], False),
    ],
    ids=[
        "moe-unset",
        "moe-true",
        "moe-false",
        "dense-unset",
        "unreadable-true",
        "extra-args-off",
        "extra-args-on",
        "unreadable-resolved-on",
        "unreadable-resolved-off",
        "unreadable-unresolved",
        "readable-dense-resolved-on",
        "unreadable-false-resolved-on",
        "unreadable-resolved-on-extra-args-off",
    ],
)
def test_local_engines_answer_routing_when_the_job_records_it(
    tmp_path: Path, model: str, replay: bool | None, resolved: bool | None, extra_args: list[str], flagged: bool
) -> None:
    paths = {"moe": write_model(tmp_path, "moe", MOE_CONFIG), "dense": write_model(tmp_path, "dense", DENSE_CONFIG)}
    spec = spec_for(paths.get(model, tmp_path / model), replay, engines={"extra_args": extra_args})
    argv = local_layout.engine_record(tmp_path, spec, 0, PlatformTokens(), record_routing=resolved).argv
    assert argv.count(ENGINE_ROUTING_FLAG) == int(flagged)


@pytest.mark.parametrize("resolved", [True, False, None])
async def test_engines_a_resize_adds_after_a_controller_restart_follow_the_resolved_routing(
    tmp_path: Path, resolved: bool | None
) -> None:
    """The answer given at start is kept in state.json: a new controller's resize plans engines from it. (Nothing
    runs: the process table only records what it would spawn.)"""
    spec = spec_for(tmp_path / "absent", None)
    spawned: list[list[str]] = []

    def local_backend() -> LocalJobBackend:
        backend = LocalJobBackend(SharedServices("redis://r", "", "", "", "", "", "", ""), tmp_path / "state")
        backend.table.spawn = lambda record, pid_dir: spawned.append(record.argv)  # type: ignore[method-assign]
        backend.table.stop_all = lambda records, grace_s: None  # type: ignore[method-assign]
        backend._ensure_monitor = lambda job_id: None  # type: ignore[method-assign]
        return backend

    first = local_backend()
    await first.start("job-1", spec, record_routing=resolved)
    await first.close()
    restarted = local_backend()
    try:
        await restarted.resize("job-1", spec, engines=2, rollout_workers=None)
    finally:
        await restarted.close()
    engines = [argv for argv in spawned if argv[0].endswith("miles-engine")]
    assert len(engines) == 2  # engine-0 at start, engine-1 by the resize
    assert [argv.count(ENGINE_ROUTING_FLAG) for argv in engines] == [int(bool(resolved))] * 2


@pytest.mark.integration
async def test_submitting_replay_for_a_dense_model_is_a_422_and_stores_nothing(
    redis_url: str, controller_kit: Any, tmp_path: Path
) -> None:
    kit = controller_kit
    dense = write_model(tmp_path, "dense", DENSE_CONFIG)
    moe = write_model(tmp_path, "moe", MOE_CONFIG)
    backend = kit.FakeBackend()
    async with kit.running(kit.make_settings(redis_url), backend) as client:
        body = kit.job_spec_body()
        body["model"] = {"path": str(dense), "family": "qwen3"}
        body["train"] = {**body["train"], "routing_replay": True}
        response = await client.post("/v1/jobs", json=body)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert (error["code"], error["field"]) == ("routing_replay_needs_moe", "train.routing_replay")
        assert (await client.get("/v1/jobs")).json()["jobs"] == []
        assert backend.calls == []  # refused before the backend was asked
        body["model"]["path"] = str(moe)
        accepted = await client.post("/v1/jobs", json=body)
        assert accepted.status_code == 201, accepted.text
        assert accepted.json()["spec"]["train"]["routing_replay"] is True
