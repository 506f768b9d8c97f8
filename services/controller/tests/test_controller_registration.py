"""The controller registers a job with the real shared services (session server, buffer) before its backend
starts, and unregisters it on DELETE. Real subprocesses and Redis; the backend is the test's fake."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.buffer.client import BufferClient
from miles.common.errors import InvalidArgumentError
from miles.common.jobspec.job import JobSpec
from miles.common.testing.ports import free_port
from miles.common.testing.processes import ServiceProcess
from miles.common.testing.smoke import console_script
from miles.session.tito.assets import bundled_tokenizer_dir

pytestmark = pytest.mark.integration
OPERATOR_TOKEN = "operator-token-0123456789abcdef0123"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A Hugging Face layout the session server can load a tokenizer from (Qwen3's real tokenizer files)."""
    folder = tmp_path / "qwen3"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(bundled_tokenizer_dir("qwen3") / name, folder / name)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 151936}))
    return folder


@pytest.fixture
def moe_model_dir(model_dir: Path) -> Path:
    """The same tokenizer under a Qwen3-MoE config.json (3 MoE layers x top 2 of 8 experts): what decides routing."""
    folder = model_dir.parent / "qwen3-moe"
    shutil.copytree(model_dir, folder)
    config = {"model_type": "qwen3_moe", "vocab_size": 151936, "num_hidden_layers": 3, "num_experts": 8}
    (folder / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 2}))
    return folder


@pytest.fixture
def shared_services(redis_url: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    buffer_port, buffer_metrics_port, session_port = free_port(), free_port(), free_port()
    buffer = ServiceProcess(
        [console_script("miles-buffer")],
        ready_url=f"http://127.0.0.1:{buffer_metrics_port}/readyz",
        env={
            "MILES_BUFFER_REDIS_URL": redis_url,
            "MILES_BUFFER_PORT": str(buffer_port),
            "MILES_BUFFER_METRICS_PORT": str(buffer_metrics_port),
        },
        log_path=tmp_path / "buffer.log",
    )
    session = ServiceProcess(
        [console_script("miles-session-server")],
        ready_url=f"http://127.0.0.1:{session_port}/readyz",
        env={
            "MILES_SESSION_REDIS_URL": redis_url,
            "MILES_SESSION_PORT": str(session_port),
            "MILES_SESSION_OPERATOR_TOKEN": OPERATOR_TOKEN,
            "MILES_SESSION_UPSTREAM_URL": f"http://127.0.0.1:{free_port()}",
        },
        log_path=tmp_path / "session.log",
    )
    with buffer, session:
        yield {"buffer_address": f"127.0.0.1:{buffer_port}", "session_url": f"http://127.0.0.1:{session_port}"}


async def _buffer_knows(address: str, job_id: str) -> bool:
    async with BufferClient(address) as client:
        try:
            await client.pull_batch(job_id, num_groups=1, trainer_version=0, max_staleness=1, lease_s=10)
        except InvalidArgumentError:
            return False
    return True


async def test_job_is_registered_before_the_backend_starts_and_unregistered_on_delete(
    redis_url: str, shared_services: dict[str, str], model_dir: Path, controller_kit: Any
) -> None:
    kit = controller_kit
    session_url = shared_services["session_url"]
    operator = {"authorization": f"Bearer {OPERATOR_TOKEN}"}
    seen_at_start: dict[str, Any] = {}

    class CheckingBackend(kit.FakeBackend):  # type: ignore[misc, name-defined]
        async def start(self, job_id: str, spec: JobSpec, *, record_routing: bool | None = None) -> None:
            async with httpx.AsyncClient() as http:
                seen_at_start["config"] = (
                    await http.get(f"{session_url}/v1/jobs/{job_id}/config", headers=operator)
                ).json()
            seen_at_start["buffer"] = await _buffer_knows(shared_services["buffer_address"], job_id)
            await super().start(job_id, spec, record_routing=record_routing)

    settings = kit.make_settings(redis_url, session_operator_token=OPERATOR_TOKEN, **shared_services)
    body = kit.job_spec_body(num_steps=2)
    body["model"] = {"path": str(model_dir), "family": "qwen3", "chat_template_kwargs": {"enable_thinking": False}}
    async with kit.running(settings, CheckingBackend()) as client:
        job_id = (await client.post("/v1/jobs", json=body)).json()["job_id"]
        await kit.wait_for_state(client, job_id, "SUCCEEDED")
        assert seen_at_start["config"]["engine_pool"] == job_id
        assert seen_at_start["config"]["model_path"] == str(model_dir)
        assert seen_at_start["config"]["chat_template_kwargs"] == {"enable_thinking": False}
        assert seen_at_start["buffer"] is True
        assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 204
        async with httpx.AsyncClient() as http:
            gone = await http.get(f"{session_url}/v1/jobs/{job_id}/config", headers=operator)
        assert gone.status_code == 404
        assert await _buffer_knows(shared_services["buffer_address"], job_id) is False


async def test_unreachable_shared_service_is_retried_then_fails_the_job(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    backend = kit.FakeBackend()
    dead = f"http://127.0.0.1:{free_port()}"
    settings = kit.make_settings(redis_url, session_url=dead, max_start_attempts=3, shared_call_timeout_s=1.0)
    async with kit.running(settings, backend) as client:
        job_id = (await client.post("/v1/jobs", json=kit.job_spec_body())).json()["job_id"]
        job = await kit.wait_for_state(client, job_id, "FAILED")
        assert "session server unreachable" in job["errors"][-1]
        assert sum("start attempt" in error for error in job["errors"]) == 2
        assert ("start", job_id) not in backend.calls  # never started without its registration


async def test_routing_replay_reaches_the_session_servers_job_config(
    redis_url: str, shared_services: dict[str, str], model_dir: Path, moe_model_dir: Path, controller_kit: Any
) -> None:
    """record_routing is train.routing_replay when set; unset, the session server resolves it from the model. The
    value it answers is what the backend's start gets (for the engines' flag)."""
    kit = controller_kit
    session_url = shared_services["session_url"]
    operator = {"authorization": f"Bearer {OPERATOR_TOKEN}"}
    settings = kit.make_settings(redis_url, session_operator_token=OPERATOR_TOKEN, **shared_services)
    cases = [(model_dir, None, False), (moe_model_dir, None, True), (moe_model_dir, False, False)]
    backend = kit.FakeBackend()
    async with kit.running(settings, backend) as client, httpx.AsyncClient() as http:
        for model, replay, recorded in cases:
            body = kit.job_spec_body(num_steps=1)
            body["model"] = {"path": str(model), "family": "qwen3"}
            if replay is not None:
                body["train"] = {**body["train"], "routing_replay": replay}
            job_id = (await client.post("/v1/jobs", json=body)).json()["job_id"]
            await kit.wait_for_state(client, job_id, "SUCCEEDED")
            config = (await http.get(f"{session_url}/v1/jobs/{job_id}/config", headers=operator)).json()
            assert config["record_routing"] is recorded, (model.name, replay, config)
            assert backend.record_routing[job_id] is recorded, (model.name, replay)


async def test_a_job_on_a_shared_pool_is_registered_with_the_pool_and_its_adapter(
    redis_url: str, shared_services: dict[str, str], model_dir: Path, controller_kit: Any
) -> None:
    """The session server routes the job's sessions to the shared pool and puts the job's adapter on every request
    (`lora_adapter`); a job with its own engines keeps its own pool and no adapter."""
    kit = controller_kit
    session_url = shared_services["session_url"]
    operator = {"authorization": f"Bearer {OPERATOR_TOKEN}"}
    pool = {"name": "shared-lora", "model_path": str(model_dir)}
    settings = kit.make_settings(
        redis_url, session_operator_token=OPERATOR_TOKEN, shared_pools=[pool], **shared_services
    )
    model = {"path": str(model_dir), "family": "qwen3"}
    on_pool = kit.job_spec_body(num_steps=1, model=model)
    on_pool["train"] = {**on_pool["train"], "lora": {"rank": 4}}
    on_pool["resources"] = {"engines": {"shared_pool": "shared-lora"}}
    own = kit.job_spec_body(num_steps=1, model=model)
    async with kit.running(settings, kit.FakeBackend()) as client, httpx.AsyncClient() as http:
        for body, pool_of, adapter in ((on_pool, lambda _: "shared-lora", True), (own, lambda job: job, False)):
            job_id = (await client.post("/v1/jobs", json=body)).json()["job_id"]
            await kit.wait_for_state(client, job_id, "SUCCEEDED")
            config = (await http.get(f"{session_url}/v1/jobs/{job_id}/config", headers=operator)).json()
            assert config["engine_pool"] == pool_of(job_id) and config.get("lora_adapter", False) is adapter, config
