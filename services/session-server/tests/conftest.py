"""Shared fixtures of the session-server tests: TITO tokenizers on the real offline assets, model directories,
a scripted SGLang-protocol engine, and real engine / session-server subprocesses.

Tests run with --import-mode=importlib, so helpers are handed out as fixtures rather than imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import Request  # module level: FastAPI resolves the route's string annotations here

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.session.tito import Family, TitoTokenizer, get_family
from miles.session.tito.assets import verification_codec

WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def weather_call(city: str = "Paris", arguments: str | None = None, call_id: str = "call_0") -> dict[str, Any]:
    args = arguments if arguments is not None else f'{{"city": "{city}"}}'
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}


def make_tito(name: str, **family_changes: Any) -> TitoTokenizer:
    """The family's TITO tokenizer on its verification codec, optionally with family fields replaced."""
    family: Family = get_family(name)
    if family_changes:
        family = dataclasses.replace(family, **family_changes)
    return TitoTokenizer(family, verification_codec(get_family(name)))


@pytest.fixture(name="weather_tools", scope="session")
def weather_tools_fixture() -> list[dict[str, Any]]:
    return WEATHER_TOOLS


@pytest.fixture(name="weather_call", scope="session")
def weather_call_fixture() -> Callable[..., dict[str, Any]]:
    return weather_call


@pytest.fixture(name="make_tito", scope="session")
def make_tito_fixture() -> Callable[..., TitoTokenizer]:
    return make_tito


@pytest.fixture(scope="session")
def qwen3() -> TitoTokenizer:
    return make_tito("qwen3")


@pytest.fixture(scope="session")
def glm47() -> TitoTokenizer:
    return make_tito("glm-4.7")


# --- session service fixtures ---------------------------------------------------------------------------------

OPERATOR_TOKEN = "op-" + "x" * 40
QWEN3_EOS_ID = 151645


def _write_qwen3_model_dir(folder: Path) -> Path:
    """A model directory in the Hugging Face layout: the real Qwen3 tokenizer files (with Qwen3's chat template)
    and a config.json (enough for `miles-engine --fake-model`)."""
    from miles.session.tito.assets import bundled_tokenizer_dir

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(bundled_tokenizer_dir("qwen3") / name, folder / name)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "eos_token_id": QWEN3_EOS_ID,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_qwen3_model_dir(tmp_path_factory.mktemp("models") / "qwen3-tokenizer")


@pytest.fixture(scope="session")
def qwen3_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3 tokenizer with a Qwen3-MoE config.json (the scripted engine's routing shape), no weights."""
    folder = _write_qwen3_model_dir(tmp_path_factory.mktemp("models") / "qwen3-moe-tokenizer")
    config = json.loads((folder / "config.json").read_text())
    config.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_hidden_layers=ScriptedEngine.ROUTING_LAYERS,
        num_experts=ScriptedEngine.ROUTING_EXPERTS,
        num_experts_per_tok=ScriptedEngine.ROUTING_TOP_K,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Qwen3-MoE model (4 sparse layers, 8 experts, top-2, real Qwen3 tokenizer), built here."""
    engine_tiny_model = pytest.importorskip("miles.engine.tiny_model")
    return Path(engine_tiny_model.build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", moe=True))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Qwen3 model (`make tiny-model`'s output when present, else built here)."""
    made = Path(__file__).resolve().parents[3] / ".miles" / "models" / "tiny-qwen3"
    if (made / "model.safetensors").is_file():
        return made
    engine_tiny_model = pytest.importorskip("miles.engine.tiny_model")
    return Path(engine_tiny_model.build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3"))


class _ThreadServer:
    """An ASGI app served by uvicorn in a daemon thread on a free port (an in-test HTTP peer)."""

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[dict[str, Any]] = []
        """Every /generate request: {"body", "headers"}."""
        self.responses: list[dict[str, Any]] = []
        """Every finished generation: {"input_ids", "output_ids", "logprobs", "cached_tokens"}."""
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def app(self) -> Any:
        raise NotImplementedError

    def record(self, input_ids: list[int], final: dict[str, Any]) -> None:
        entries = final["meta_info"]["output_token_logprobs"]
        self.responses.append(
            {
                "input_ids": input_ids,
                "output_ids": [e[1] for e in entries],
                "logprobs": [e[0] for e in entries],
                "cached_tokens": final["meta_info"].get("cached_tokens"),
                "routed_experts": final["meta_info"].get("routed_experts"),
            }
        )

    def start(self) -> Any:
        import uvicorn

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


class ScriptedEngine(_ThreadServer):
    """A test engine speaking SGLang's native /generate (exact shapes: 3-element logprob entries, finish_reason
    objects, cumulative or delta SSE chunks ending in [DONE]) whose completions are scripted text.

    Used where the real tiny model cannot help: a random model never emits a tool call, an error status or a
    malformed body. Completion i is `script[i % len(script)]` encoded with the real Qwen3 tokenizer + <|im_end|>;
    the logprob of a token is a deterministic function of its position; cached_tokens is the longest prefix shared
    with an earlier prompt (a radix cache's answer). With `return_routed_experts` it answers routing as SGLang
    does for a MoE model of ROUTING_LAYERS x ROUTING_TOP_K of ROUTING_EXPERTS experts (`routing_ids`: a function of
    the tokens up to each position, so prefix-consistent like a real engine's); `routing_rows_delta` answers that
    many rows more (negative: fewer), `omit_routing` none. With `loaded_adapters` set, a `lora_path` outside it is
    SGLang's 400 "not loaded"; `on_generate(body)` runs (in the engine's thread) before each answer. With
    `hold_answers_until` = n, no generation is answered before n /generate requests arrived (concurrent turns all
    past their phase 1).
    """

    ROUTING_LAYERS, ROUTING_TOP_K, ROUTING_EXPERTS = 4, 2, 8

    def __init__(self, codec: Any) -> None:
        super().__init__()
        self.codec = codec
        self.script: list[str] = ["Hello."]
        self.delta_stream = False
        self.fail_next: list[tuple[int, Any]] = []
        """(status, body) answered instead of the next generations, in order."""
        self.routing_rows_delta = 0
        self.omit_routing = False
        self.loaded_adapters: set[str] | None = None
        self.on_generate: Callable[[dict[str, Any]], None] | None = None
        self.hold_answers_until = 0
        self._all_arrived: asyncio.Event | None = None
        self._seen: list[list[int]] = []
        self._num_calls = 0

    @classmethod
    def routing_ids(cls, tokens: list[int], start: int, end: int) -> list[int]:
        """Flat expert ids of positions [start, end): each position's from a running hash of the tokens up to it."""
        ids: list[int] = []
        running = 7
        for position, token in enumerate(tokens[:end]):
            running = (running * 1_000_003 + token + 1) % (1 << 61)
            if position >= start:
                for layer in range(cls.ROUTING_LAYERS):
                    first = (running >> (3 * layer)) % cls.ROUTING_EXPERTS
                    ids += [(first + k) % cls.ROUTING_EXPERTS for k in range(cls.ROUTING_TOP_K)]
        return ids

    def _routing(self, body: dict[str, Any], prompt: list[int], ids: list[int]) -> str:
        import base64
        from array import array

        start = int(body.get("routed_experts_start_len", 0))
        end = len(prompt) + len(ids) - 1 + self.routing_rows_delta
        packed = array("i", self.routing_ids([*prompt, *ids, *([0] * max(0, self.routing_rows_delta))], start, end))
        return base64.b64encode(packed.tobytes()).decode()

    @staticmethod
    def logprob(position: int) -> float:
        return -0.01 * (1 + position % 50)

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for old in self._seen:
            n = 0
            while n < min(len(old), len(prompt)) and old[n] == prompt[n]:
                n += 1
            best = max(best, n)
        self._seen.append(list(prompt))
        return min(best, len(prompt) - 1)

    def _body(self, prompt: list[int], ids: list[int], finish: Any, cached: int) -> dict[str, Any]:
        entries = [[self.logprob(len(prompt) + i), t, None] for i, t in enumerate(ids)]
        return {
            "text": self.codec.decode(ids),
            "output_ids": ids,
            "meta_info": {
                "id": "rid",
                "finish_reason": finish,
                "weight_version": "3",
                "prompt_tokens": len(prompt),
                "cached_tokens": cached,
                "completion_tokens": len(ids),
                "output_token_logprobs": entries,
            },
        }

    def app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            self.requests.append({"body": body, "headers": dict(request.headers)})
            if self.on_generate is not None:
                self.on_generate(body)
            if self.hold_answers_until:
                self._all_arrived = self._all_arrived or asyncio.Event()  # made on the engine's own loop
                if len(self.requests) >= self.hold_answers_until:
                    self._all_arrived.set()
                await asyncio.wait_for(self._all_arrived.wait(), timeout=30.0)
            if self.fail_next:
                status, payload = self.fail_next.pop(0)
                if isinstance(payload, str):
                    return PlainTextResponse(payload, status_code=status)
                return JSONResponse(payload, status_code=status)
            lora_path = body.get("lora_path")
            if lora_path is not None and self.loaded_adapters is not None and lora_path not in self.loaded_adapters:
                message = (
                    f"The following requested LoRA adapters are not loaded: {lora_path}\n"
                    f"Loaded adapters: {', '.join(sorted(self.loaded_adapters))}"
                )
                return JSONResponse({"error": {"message": message}}, status_code=400)
            prompt = body["input_ids"]
            text = self.script[self._num_calls % len(self.script)]
            self._num_calls += 1
            ids = [*self.codec.encode(text), QWEN3_EOS_ID]
            max_new = (body.get("sampling_params") or {}).get("max_new_tokens")
            finish: dict[str, Any] = {"type": "stop", "matched": QWEN3_EOS_ID}
            if max_new is not None and len(ids) > max_new:
                ids, finish = ids[:max_new], {"type": "length", "length": max_new}
            cached = self._cached(prompt)
            final = self._body(prompt, ids, finish, cached)
            if body.get("return_routed_experts") and not self.omit_routing:
                final["meta_info"]["routed_experts"] = self._routing(body, prompt, ids)
            self.record(prompt, final)
            if not body.get("stream"):
                return JSONResponse(final)

            async def events() -> Any:
                for n in range(1, len(ids) + 1):
                    chunk = final if n == len(ids) else self._body(prompt, ids[:n], None, cached)
                    if self.delta_stream:
                        chunk["meta_info"]["output_token_logprobs"] = chunk["meta_info"]["output_token_logprobs"][-1:]
                        chunk["output_ids"] = ids[n - 1 : n]
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return app


class RecordingProxy(_ThreadServer):
    """A pass-through /generate proxy in front of a real engine (where the router sits), recording every request
    and the engine's final answer, so tests can check what the engine really consumed and sampled."""

    def __init__(self, engine_url: str) -> None:
        super().__init__()
        self.engine_url = engine_url

    def app(self) -> Any:
        import httpx
        from fastapi import FastAPI
        from fastapi.responses import Response, StreamingResponse

        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            self.requests.append({"body": body, "headers": dict(request.headers)})
            client = httpx.AsyncClient(base_url=self.engine_url, timeout=300)
            if not body.get("stream"):
                reply = await client.post("/generate", json=body)
                await client.aclose()
                if reply.status_code == 200:
                    self.record(body["input_ids"], reply.json())
                return Response(reply.content, status_code=reply.status_code, media_type="application/json")

            async def events() -> Any:
                async with client.stream("POST", "/generate", json=body) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[len("data: ") :])
                            if chunk["meta_info"].get("finish_reason") is not None:
                                # Recorded before the final chunk reaches the caller: the session server may close
                                # the stream as soon as it has it, cancelling this generator before [DONE].
                                self.record(body["input_ids"], chunk)
                        yield line + "\n"
                await client.aclose()

            return StreamingResponse(events(), media_type="text/event-stream")

        return app


@pytest.fixture(scope="session")
def recording_proxy_class() -> type[RecordingProxy]:
    return RecordingProxy


@pytest.fixture(scope="session")
def qwen3_codec(qwen3_model_dir: Path) -> Any:
    from miles.session.tito import HFTokenizerCodec

    return HFTokenizerCodec.from_file(qwen3_model_dir)


@pytest.fixture
def scripted_engine(qwen3_codec: Any) -> Iterator[ScriptedEngine]:
    engine = ScriptedEngine(qwen3_codec).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def start_process(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., contextlib.AbstractContextManager[str]]:
    """`with start_process(argv, env) as url:` a real subprocess on a free port ({port} in argv/env is replaced)."""

    @contextlib.contextmanager
    def start(argv: list[str], env: dict[str, str] | None = None, *, ready_timeout_s: float = 120.0) -> Iterator[str]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [a.replace("{port}", str(port)) for a in argv]
        env = {k: v.replace("{port}", str(port)) for k, v in (env or {}).items()}
        log_path = tmp_path_factory.mktemp("logs") / f"{Path(argv[0]).name}-{port}.log"
        process = ServiceProcess(argv, ready_url=f"{url}/readyz", env=env, log_path=log_path)
        with process.start(ready_timeout_s=ready_timeout_s):
            yield url

    return start


@pytest.fixture(scope="session")
def fake_engine_url(
    qwen3_model_dir: Path, start_process: Callable[..., contextlib.AbstractContextManager[str]]
) -> Iterator[str]:
    """A real `miles-engine --fake-model` (deterministic hash sampler, no torch; real protocol and scheduler)."""
    argv = [console_script("miles-engine"), "--model-path", str(qwen3_model_dir), "--port", "{port}", "--fake-model"]
    with start_process(argv) as url:
        yield url


def _session_env(redis_url: str, upstream_url: str, model_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        "MILES_SESSION_PORT": "{port}",
        "MILES_SESSION_REDIS_URL": redis_url,
        "MILES_SESSION_UPSTREAM_URL": upstream_url,
        "MILES_SESSION_OPERATOR_TOKEN": OPERATOR_TOKEN,
        "MILES_SESSION_DEFAULT_MODEL_PATH": str(model_dir),
        "MILES_SESSION_DEFAULT_MODEL_FAMILY": "qwen3",
        "MILES_SESSION_DEFAULT_ENGINE_POOL": "pool-a",
        "MILES_SESSION_LOG_JSON": "false",
    }
    return {**env, **extra}


@pytest.fixture(scope="session")
def session_env() -> Callable[..., dict[str, str]]:
    """`session_env(redis_url, upstream_url, model_dir, **extra)`: a session server's environment ({port} free)."""
    return _session_env


@pytest.fixture(scope="session")
def session_server_argv() -> list[str]:
    return [console_script("miles-session-server")]


@pytest.fixture(scope="session")
def operator_token() -> str:
    return OPERATOR_TOKEN


@pytest.fixture(scope="session")
def shared_models() -> Any:
    """One model cache for every in-process app of the test session (a tokenizer load takes ~1 s)."""
    from miles.session.model_assets import ModelRegistry

    return ModelRegistry(cache_size=4)


@pytest.fixture
def make_session_app(
    qwen3_model_dir: Path, shared_models: Any
) -> Callable[..., contextlib.AbstractAsyncContextManager[Any]]:
    """`async with make_session_app(upstream_url, **settings) as client:` the service in-process (httpx ASGI)."""
    import httpx

    from miles.common.telemetry import Metrics
    from miles.session.main import build_service
    from miles.session.settings import SessionSettings

    @contextlib.asynccontextmanager
    async def start(upstream_url: str, **overrides: Any) -> Any:
        values: dict[str, Any] = {
            "store_backend": "memory",
            "upstream_url": upstream_url,
            "operator_token": OPERATOR_TOKEN,
            "default_model_path": str(qwen3_model_dir),
            "default_model_family": "qwen3",
            "default_engine_pool": "pool-a",
            **overrides,
        }
        app = build_service(SessionSettings(**values), Metrics("session"), models=shared_models)
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://s") as c:
            c.app = app  # type: ignore[attr-defined]
            yield c

    return start
