"""Test helpers of the rollout-router: small SGLang-shaped engines over real sockets, and an in-process router.

`FakeEngine` is a hand-written HTTP/1.1 server on asyncio streams (not a web framework) so that tests can make it
fail the way real engines fail: refuse connections (stopped), close the socket before answering, die in the
middle of a body or a stream, answer 5xx, be slow. It speaks the /generate protocol shape (docs/sglang-protocol.md §1:
`text`/`output_ids`/`meta_info` with `prompt_tokens`, `cached_tokens` from a real longest-prefix cache,
`weight_version`; SSE with cumulative chunks and `data: [DONE]`), the OpenAI routes with `usage`, and
/health, /model_info, /server_info (and /health_generate when `generating` is set). These stay for failure
injection; test_router_engines_integration.py runs the router against real `miles-engine --fake-model` processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from miles.common.serve import serve_async
from miles.common.telemetry import Metrics
from miles.router.core import RouterService
from miles.router.http_api import create_app
from miles.router.main import build_admin_grpc
from miles.router.settings import RouterSettings

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 409: "Conflict", 500: "Internal Server Error"}


@dataclass
class ReceivedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeEngine:
    """An engine with knobs. `mode`: ok | error_500 | error_503 | die_before_headers | die_mid_body |
    stream_die (after `die_after_events` SSE events). `delay_s`: sleep before answering (and between events).
    `generating`: /health_generate answers 200 (True), 503 (False: paused), or 404 (None: no such route)."""

    weight_version: int | str = 0
    mode: str = "ok"
    delay_s: float = 0.0
    die_after_events: int = 1
    healthy: bool = True
    generating: bool | None = None
    max_running_requests: int | None = None
    max_total_num_tokens: int | None = None
    num_output_tokens: int = 4
    extra_response_field: Any = field(default_factory=lambda: {"engine_only": [1, 2, {"x": None}]})
    requests: list[ReceivedRequest] = field(default_factory=list)
    last_response_body: bytes = b""
    num_in_flight: int = 0
    max_in_flight_seen: int = 0
    port: int = 0
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _cache: list[list[int]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def generate_requests(self) -> list[ReceivedRequest]:
        return [r for r in self.requests if r.path in ("/generate", "/v1/chat/completions", "/v1/completions")]

    async def start(self) -> FakeEngine:
        self._server = await asyncio.start_server(self._serve_connection, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Close the listener and every connection: what a killed engine looks like to the router."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()
        self._server = None

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                keep_going = await self._dispatch(request, writer)
                if not keep_going:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _dispatch(self, request: ReceivedRequest, writer: asyncio.StreamWriter) -> bool:
        self.requests.append(request)
        if request.path == "/health":
            await _respond(writer, 200 if self.healthy else 503, b"")
            return True
        if request.path == "/health_generate" and self.generating is not None:
            await _respond(writer, 200 if self.generating else 503, b"")
            return True
        if request.path in ("/model_info", "/get_model_info"):
            await _respond_json(writer, 200, {"model_path": "fake", "weight_version": str(self.weight_version)})
            return True
        if request.path in ("/server_info", "/get_server_info"):
            info = {
                "max_running_requests": self.max_running_requests,
                "max_total_num_tokens": self.max_total_num_tokens,
                "weight_version": str(self.weight_version),
            }
            await _respond_json(writer, 200, info)
            return True
        if request.path not in ("/generate", "/v1/chat/completions", "/v1/completions"):
            await _respond_json(writer, 404, {"detail": "Not Found"})
            return True
        self.num_in_flight += 1
        self.max_in_flight_seen = max(self.max_in_flight_seen, self.num_in_flight)
        try:
            return await self._generate(request, writer)
        finally:
            self.num_in_flight -= 1

    async def _generate(self, request: ReceivedRequest, writer: asyncio.StreamWriter) -> bool:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.mode == "die_before_headers":
            writer.transport.abort()
            return False
        if self.mode in ("error_500", "error_503"):
            status = 500 if self.mode == "error_500" else 503
            await _respond_json(writer, status, {"object": "error", "message": "injected", "code": status})
            return True
        try:
            payload = json.loads(request.body)
        except ValueError as exc:
            await _respond_json(writer, 400, {"error": {"message": f"malformed JSON: {exc}"}})
            return True
        min_version = payload.get("min_weight_version")
        if isinstance(min_version, int) and int(self.weight_version) < min_version:
            await _respond_json(writer, 409, {"error": {"message": "engine behind min_weight_version"}})
            return True
        answer = self._answer(request.path, payload)
        if payload.get("stream"):
            return await self._stream(writer, answer)
        body = json.dumps(answer).encode()
        self.last_response_body = body
        if self.mode == "die_mid_body":
            head = _head(200, {"content-type": "application/json", "content-length": str(len(body))})
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            writer.transport.abort()
            return False
        await _respond(writer, 200, body, "application/json")
        return True

    def _answer(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        prompt = _prompt_ids(path, payload)
        cached = max((_common_prefix(prompt, seq) for seq in self._cache), default=0)
        cached = min(cached, max(len(prompt) - 1, 0))
        output_ids = [1000 + i for i in range(self.num_output_tokens)]
        self._cache.append(prompt + output_ids[:-1])
        meta = {
            "id": "fake",
            "finish_reason": {"type": "length", "length": self.num_output_tokens},
            "prompt_tokens": len(prompt),
            "completion_tokens": len(output_ids),
            "cached_tokens": cached,
            "weight_version": str(self.weight_version),
        }
        if path == "/generate":
            generated = {"text": "abcd", "output_ids": output_ids, "meta_info": meta, "engine": self.url}
            return {**generated, "extra": self.extra_response_field}
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(output_ids),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        choice = {"index": 0, "message": {"role": "assistant", "content": "abcd"}}
        return {"id": "cmpl", "object": "chat.completion", "engine": self.url, "usage": usage, "choices": [choice]}

    async def _stream(self, writer: asyncio.StreamWriter, answer: dict[str, Any]) -> bool:
        writer.write(_head(200, {"content-type": "text/event-stream", "transfer-encoding": "chunked"}))
        output_ids = answer.get("output_ids", [1])
        events: list[bytes] = []
        for index in range(1, len(output_ids) + 1):
            chunk = dict(answer)
            chunk["output_ids"] = output_ids[:index]
            meta = dict(answer.get("meta_info", {}))
            meta["completion_tokens"] = index
            if index < len(output_ids):
                meta["finish_reason"] = None
            chunk["meta_info"] = meta
            events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        self.last_response_body = b"".join(events)
        for number, event in enumerate(events):
            if self.mode == "stream_die" and number >= self.die_after_events:
                await writer.drain()
                writer.transport.abort()
                return False
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


def _prompt_ids(path: str, payload: dict[str, Any]) -> list[int]:
    ids = payload.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], int):
        return list(ids)
    if path == "/v1/chat/completions":
        text = " ".join(str(m.get("content", "")) for m in payload.get("messages", []))
    else:
        text = payload.get("text") or payload.get("prompt") or ""
    return [ord(char) for char in str(text)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


async def _read_request(reader: asyncio.StreamReader) -> ReceivedRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return ReceivedRequest(method, path.split("?", 1)[0], headers, body)


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _respond(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str = "text/plain") -> None:
    writer.write(_head(status, {"content-type": content_type, "content-length": str(len(body))}) + body)
    await writer.drain()


async def _respond_json(writer: asyncio.StreamWriter, status: int, payload: object) -> None:
    await _respond(writer, status, json.dumps(payload).encode(), "application/json")


# --- the router, in process, over real sockets -----------------------------------------------------------------
@dataclass
class RunningRouter:
    service: RouterService
    url: str
    grpc_port: int | None
    metrics: Metrics
    client: httpx.AsyncClient

    def pool(self, name: str = "default") -> Any:
        return self.service.registry.pools[name]


def router_settings(**overrides: Any) -> RouterSettings:
    """Settings tuned for fast tests (short intervals, tiny backoff); override anything."""
    values: dict[str, Any] = {
        "port": 0,
        "admin_grpc_port": 0,
        "health_check_interval_s": 0.2,
        # Generous: a fake engine answers /health at once, but a loaded 2-core CI box can stall the test's event
        # loop for seconds, and a registration probe that times out marks the engine unhealthy (CI, stop 39).
        "health_check_timeout_s": 10.0,
        "version_poll_interval_s": 0.2,
        "retry_backoff_initial_s": 0.01,
        "retry_backoff_max_s": 0.05,
        "request_timeout_s": 30.0,
        "connect_timeout_s": 2.0,
        "log_json": False,
    }
    values.update(overrides)
    return RouterSettings(**values)


@contextlib.asynccontextmanager
async def run_router(**overrides: Any) -> AsyncIterator[RunningRouter]:
    """A RouterService with its HTTP app and gRPC admin server on free loopback ports, stopped on exit."""
    settings = router_settings(**overrides)
    metrics = Metrics("router")
    service = RouterService.build(settings, metrics)
    await service.start()
    stop = asyncio.Event()
    ports: asyncio.Future[tuple[int | None, int | None]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_async(
            http_app=create_app(service, metrics),
            http_port=0,
            grpc_server=build_admin_grpc(service, settings, metrics),
            grace_s=1.0,
            on_started=lambda http_port, grpc_port: ports.set_result((http_port, grpc_port)),
            on_shutdown=[service.stop],
            stop_event=stop,
            handle_signals=False,
        )
    )
    http_port, grpc_port = await ports
    url = f"http://127.0.0.1:{http_port}"
    async with httpx.AsyncClient(base_url=url, timeout=30.0, trust_env=False) as client:
        try:
            yield RunningRouter(service, url, grpc_port, metrics, client)
        finally:
            stop.set()
            await task


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Any]]:
    """Factory of started FakeEngines (`await engines(n, **knobs)` → list), all stopped after the test."""
    started: list[FakeEngine] = []

    async def make(count: int = 1, **knobs: Any) -> list[FakeEngine]:
        new = [await FakeEngine(**knobs).start() for _ in range(count)]
        started.extend(new)
        return new

    yield make
    for engine in started:
        await engine.stop()


async def wait_until(predicate: Callable[[], bool], *, attempts: int = 200, interval_s: float = 0.05) -> None:
    """Poll a condition (event-driven tests would need hooks in the code under test); fails after `attempts`."""
    for _ in range(attempts):
        if predicate():
            return
        await asyncio.sleep(interval_s)
    raise AssertionError("condition not reached")


# --- pools without sockets, for unit tests ------------------------------------------------------------------------
@dataclass
class FakeClock:
    now_s: float = 1000.0

    def __call__(self) -> float:
        return self.now_s


def unit_pool(
    num_engines: int, pool_name: str = "default", clock: FakeClock | None = None, **overrides: Any
) -> tuple[Any, Any, list[Any]]:
    """(registry, pool, engines): healthy engines http://e<i>:1 at weight version 0, no I/O."""
    from miles.router.engine import EngineSource
    from miles.router.metrics import RouterMetrics
    from miles.router.registry import PoolRegistry

    settings = router_settings(**overrides)
    registry = PoolRegistry(settings, RouterMetrics(Metrics("router")), clock or FakeClock())
    pool = registry.get_or_create(pool_name)
    engines = []
    for index in range(num_engines):
        engine = registry.new_engine(pool_name, f"http://e{index}:1", EngineSource.STATIC)
        engine.health.force(True)
        engine.weight_version = 0
        pool.add(engine)
        engines.append(engine)
    return registry, pool, engines


def routing(
    key: str | None = None, tokens: list[int] | None = None, min_version: int | None = None, pool: str = "default"
) -> Any:
    """A RoutingInput for /generate with optional routing key, input_ids and min_weight_version."""
    from miles.router.radix import encode_token_ids
    from miles.router.routing_input import RoutingInput

    prefix = encode_token_ids(tokens) if tokens else b""
    return RoutingInput(
        route="/generate",
        pool=pool,
        routing_key=key,
        min_weight_version=min_version,
        prefix_key=prefix or b"",
        is_token_key=bool(tokens),
        num_tokens=len(tokens) if tokens else 1,
    )


def request_from_body(body: dict[str, Any], route: str = "/generate", **headers: str) -> Any:
    """The RoutingInput the router reads from a JSON body (and lower-case headers), as the forwarder parses it."""
    from miles.router.routing_input import parse_routing_input

    return parse_routing_input(route, headers, json.dumps(body).encode(), "default")


# Test modules cannot import this conftest (--import-mode=importlib), so helpers travel as fixtures.
@pytest.fixture
def make_pool() -> Callable[..., tuple[Any, Any, list[Any]]]:
    return unit_pool


@pytest.fixture
def make_routing() -> Callable[..., Any]:
    return routing


@pytest.fixture
def make_request() -> Callable[..., Any]:
    return request_from_body


@pytest.fixture
def start_router() -> Callable[..., contextlib.AbstractAsyncContextManager[RunningRouter]]:
    return run_router


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def until() -> Callable[..., Any]:
    """`await until(predicate)`: poll a condition (see wait_until)."""
    return wait_until
