"""Shared fixtures of the engine tests: the tiny models (built once per session), an in-process LoRA engine and
real engine processes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Qwen3 model, built by our own builder into a temporary directory."""
    from miles.engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE model (4 sparse layers, 8 experts, top-2), built by our own builder."""
    from miles.engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", moe=True)


@pytest.fixture
async def lora_client(tiny_model_dir: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """A deterministic LoRA engine (2 slots, rank <= 8; an `Engine`) and an HTTP client to its app (over ASGI, in
    this process: its /metrics are this engine's alone)."""
    from miles.common.telemetry import Metrics
    from miles.engine.main import build_engine, create_app
    from miles.engine.settings import EngineSettings

    settings = EngineSettings(
        model_path=tiny_model_dir, deterministic=True, enable_lora=True, max_loras_per_batch=2, max_lora_rank=8
    )
    metrics = Metrics("engine")
    engine, served = build_engine(settings, metrics)
    app = create_app(settings, engine, served, metrics)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
            yield engine, client
    finally:
        engine.scheduler.stop()


@dataclass
class RunningEngine:
    """A miles-engine subprocess and an HTTP client to it."""

    url: str
    process: ServiceProcess
    client: httpx.Client

    def generate(self, **body: Any) -> Any:
        response = self.client.post("/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def post(self, path: str, body: Any = None) -> httpx.Response:
        return self.client.post(path, json=body)


EngineFactory = Callable[..., contextlib.AbstractContextManager[RunningEngine]]


@pytest.fixture(scope="session")
def engine_factory(tmp_path_factory: pytest.TempPathFactory) -> EngineFactory:
    """`with engine_factory(model_dir, "--deterministic", ...) as engine:` a real miles-engine on a free port."""

    @contextlib.contextmanager
    def start(model_dir: Path, *flags: str) -> Iterator[RunningEngine]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [console_script("miles-engine"), "--model-path", str(model_dir), "--port", str(port), *flags]
        log_path = tmp_path_factory.mktemp("engine-logs") / f"engine-{port}.log"
        with (
            ServiceProcess(argv, ready_url=f"{url}/readyz", log_path=log_path) as process,
            httpx.Client(base_url=url, timeout=120.0) as client,
        ):
            yield RunningEngine(url, process, client)

    return start
