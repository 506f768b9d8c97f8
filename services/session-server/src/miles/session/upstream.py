"""The upstream call: SGLang-native `POST /generate` on the rollout router (or one engine), parsed into a Completion.

Request: `input_ids`, `sampling_params`, `return_logprob: true`, `stream` when the client streams, headers
`X-SMG-Routing-Key: <session_id>` (KV-cache affinity) and `X-Miles-Pool: <engine pool>`; for a session that records
routing also `return_routed_experts: true` and `routed_experts_start_len` (sglang-protocol.md §1.6: the answer's
`meta_info.routed_experts`, on the final chunk when streaming, is kept raw in the Completion); for a LoRA job's turn
`lora_path` (the job's live adapter, adapters.py); for a session whose metadata has `min_weight_version` (an
evaluation episode pinned to a version) the `X-Miles-Min-Weight-Version` header. The body is built field by field
here: nothing of the agent's request passes through except the sampling parameters openai_format picks. The answer
is parsed by generate_wire.py (docs/sglang-protocol.md §1.3-1.4). `generate` returns the finished Completion;
`open_stream` returns the open answer once its status is 200 (a streamed turn relays its ids as they arrive,
streaming.py), so that every refusal before that is still an HTTP error for the agent.

Errors: unreachable, timed out, 5xx/429 or an aborted generation -> 503 with Retry-After (nothing recorded, the
agent retries the same request); 400 -> 400 with the engine's message; 409 -> 409; anything malformed -> 502.

The client is aiohttp, not the httpx every other miles client uses: this call is on every turn's path, and on this
machine an aiohttp round trip costs ~0.2 ms of CPU against httpx's ~0.85 ms (a /generate with a 700-id prompt,
measured side by side), most of the session server's overhead over a bare hop. It carries the trace context and
request id like `traced_async_client`, and drops idle connections after ENGINE_KEEPALIVE_EXPIRY_S (engines may
close theirs after 5 s). A POST is never retried here: the agent retries a 503.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

from miles.common.contracts.headers import (
    MIN_WEIGHT_VERSION_HEADER,
    POOL_HEADER,
    ROUTING_KEY_HEADER,
    SESSION_MIN_WEIGHT_VERSION_KEY,
)
from miles.common.errors import MilesError
from miles.common.http_client import ENGINE_KEEPALIVE_EXPIRY_S, propagation_headers
from miles.session.errors import (
    UpstreamConflictError,
    UpstreamMalformedError,
    UpstreamRejectedError,
    UpstreamUnavailableError,
)
from miles.session.generate_wire import (
    Completion,
    StreamAccumulator,
    UpstreamAbortedError,
    malformed,
    parse_entries,
    parse_finished,
)

__all__ = ["Completion", "EngineClient", "UpstreamAbortedError", "UpstreamStream", "pinned_weight_version"]


def pinned_weight_version(metadata: Mapping[str, Any]) -> int | None:
    """The `min_weight_version` a session's metadata pins its turns to (an int >= 0; anything else: none)."""
    value = metadata.get(SESSION_MIN_WEIGHT_VERSION_KEY)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:300].decode("utf-8", "replace")
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error)[:300]


TransportError = aiohttp.ClientError | TimeoutError | OSError
"""What a broken, refused or timed-out connection raises (aiohttp's timeouts are TimeoutErrors)."""
_TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


class EngineClient:
    """One shared HTTP client (connection pool) to the upstream, opened on first use inside the event loop."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        max_connections: int,
        retry_after_s: float,
    ) -> None:
        self._url = base_url.rstrip("/") + "/generate"
        self._retry_after_s = retry_after_s
        # sock_read bounds each wait for bytes (as httpx's read timeout did), not the whole generation.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=ENGINE_KEEPALIVE_EXPIRY_S)
            # trust_env stays off: with it aiohttp reads ~/.netrc and the proxy variables in a worker thread on every
            # request (two thread hops per turn); the upstream is an in-cluster address no proxy should see.
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @staticmethod
    def _request(
        *,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        stream: bool,
        routing_key: str,
        pool: str,
        routed_experts_start_len: int | None,
        lora_path: str | None,
        min_weight_version: int | None,
    ) -> tuple[bytes, dict[str, str]]:
        """The /generate body (compact JSON) and headers."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": True,
            "stream": stream,
            "rid": uuid.uuid4().hex,
        }
        if routed_experts_start_len is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = routed_experts_start_len
        if lora_path is not None:
            body["lora_path"] = lora_path
        headers = {
            **propagation_headers(),
            "content-type": "application/json",
            ROUTING_KEY_HEADER: routing_key,
            POOL_HEADER: pool,
        }
        if min_weight_version is not None:
            headers[MIN_WEIGHT_VERSION_HEADER] = str(min_weight_version)
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode(), headers

    def _transport_error(self, exc: TransportError) -> UpstreamUnavailableError:
        if isinstance(exc, TimeoutError):
            return UpstreamUnavailableError(
                f"the upstream did not answer in time ({type(exc).__name__})", retry_after_s=self._retry_after_s
            )
        return UpstreamUnavailableError(
            f"the upstream is unreachable ({type(exc).__name__}: {exc})", retry_after_s=self._retry_after_s
        )

    async def generate(
        self,
        *,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        stream: bool,
        routing_key: str,
        pool: str,
        routed_experts_start_len: int | None = None,
        lora_path: str | None = None,
        min_weight_version: int | None = None,
    ) -> Completion:
        """One generation; with `routed_experts_start_len`, also the routed experts of positions from there on;
        with `lora_path`, served with that loaded adapter; with `min_weight_version`, only by an engine at that
        version or newer (the router's 409 otherwise)."""
        opened = await self.open_stream(
            input_ids=input_ids,
            sampling_params=sampling_params,
            stream=stream,
            routing_key=routing_key,
            pool=pool,
            routed_experts_start_len=routed_experts_start_len,
            lora_path=lora_path,
            min_weight_version=min_weight_version,
        )
        try:
            if stream:
                async for _ in opened.token_ids():
                    pass
                return opened.completion()
            raw = await opened.read()
        finally:
            opened.close()
        try:
            parsed = json.loads(raw)
        except ValueError:
            raise malformed("the body is not JSON") from None
        return parse_finished(parsed, num_prompt_tokens=len(input_ids), latency_s=opened.elapsed_s())

    async def open_stream(
        self,
        *,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        stream: bool = True,
        routing_key: str,
        pool: str,
        routed_experts_start_len: int | None = None,
        lora_path: str | None = None,
        min_weight_version: int | None = None,
    ) -> UpstreamStream:
        """The upstream's answer once its status is 200 (the body not read yet); the caller must `close()` it.
        A refusal (status, unreachable) raises here, before anything reached the agent."""
        data, headers = self._request(
            input_ids=input_ids,
            sampling_params=sampling_params,
            stream=stream,
            routing_key=routing_key,
            pool=pool,
            routed_experts_start_len=routed_experts_start_len,
            lora_path=lora_path,
            min_weight_version=min_weight_version,
        )
        started_s = time.perf_counter()
        try:
            response = await self._client().post(self._url, data=data, headers=headers)
        except _TRANSPORT_ERRORS as exc:
            raise self._transport_error(exc) from exc
        if response.status != 200:
            try:
                body = await response.read()
            except _TRANSPORT_ERRORS as exc:
                raise self._transport_error(exc) from exc
            finally:
                response.release()
            self._raise_for_status(response.status, body, response.headers)
        return UpstreamStream(
            response, num_prompt_tokens=len(input_ids), started_s=started_s, on_error=self._transport_error
        )

    def _raise_for_status(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        message = _error_message(body)
        if status == 400:
            raise UpstreamRejectedError(f"the engine rejected the request: {message}")
        if status == 409:
            raise UpstreamConflictError(f"the engine answered 409: {message}", retry_after_s=1.0)
        if status == 429 or status >= 500:
            retry_after = headers.get("retry-after", "")
            retry_after_s = float(retry_after) if retry_after.isdigit() else self._retry_after_s
            raise UpstreamUnavailableError(f"the upstream answered {status}: {message}", retry_after_s=retry_after_s)
        raise UpstreamMalformedError(f"the upstream answered {status} to /generate: {message}")


class UpstreamStream:
    """An open /generate answer (status 200): `token_ids()` yields the sampled ids as they arrive (streamed
    requests), then `completion()` is the whole generation, checked as a non-streamed one; `read()` is a
    non-streamed answer's body. Transport failures while reading are UpstreamUnavailableError; `close()` closes
    the connection unless the answer was read to its end (an unfinished generation is aborted by the engine when
    its client goes away)."""

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        *,
        num_prompt_tokens: int,
        started_s: float,
        on_error: Callable[[TransportError], MilesError],
    ) -> None:
        self._response = response
        self._num_prompt_tokens = num_prompt_tokens
        self._started_s = started_s
        self._on_error = on_error
        self._state = StreamAccumulator()
        self._read_to_end = False

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._started_s

    async def read(self) -> bytes:
        """The whole body (a non-streamed answer)."""
        try:
            body = await self._response.read()
        except _TRANSPORT_ERRORS as exc:
            raise self._on_error(exc) from exc
        self._read_to_end = True
        return body

    async def _lines(self) -> AsyncIterator[str]:
        """The body's lines without their line ends. Lines may be long (a chunk carries every logprob so far), so
        they are split here rather than by aiohttp's readline, which refuses lines over its buffer size; a line's
        pieces are joined once, when its end arrives."""
        pieces: list[bytes] = []
        async for chunk in self._response.content.iter_any():
            start = 0
            while (end := chunk.find(b"\n", start)) != -1:
                pieces.append(chunk[start:end])
                yield b"".join(pieces).rstrip(b"\r").decode()
                pieces.clear()
                start = end + 1
            if start < len(chunk):
                pieces.append(chunk[start:])
        self._read_to_end = True
        if pieces:
            yield b"".join(pieces).rstrip(b"\r").decode()

    async def token_ids(self) -> AsyncIterator[list[int]]:
        """The new sampled ids of each stream chunk (never empty), until the chunk with a finish_reason."""
        num_seen = 0
        try:
            async for line in self._lines():
                self._state.feed(line)
                if len(self._state.entries) > num_seen:
                    new_ids, _ = parse_entries(self._state.entries[num_seen:])
                    num_seen = len(self._state.entries)
                    yield new_ids
                if self._state.finished:
                    return
        except _TRANSPORT_ERRORS as exc:
            raise self._on_error(exc) from exc
        except UnicodeDecodeError:
            raise malformed("a stream line is not UTF-8") from None

    def completion(self) -> Completion:
        """The finished generation (after `token_ids()` ended); UpstreamMalformedError when it never finished."""
        return parse_finished(
            self._state.final(),
            num_prompt_tokens=self._num_prompt_tokens,
            latency_s=self.elapsed_s(),
            entries=self._state.entries,
        )

    def close(self) -> None:
        if self._read_to_end:
            self._response.release()  # back to the pool
        else:
            self._response.close()  # the engine sees its client leave and aborts the generation
