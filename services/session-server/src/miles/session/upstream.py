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
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx

from miles.common.contracts.headers import (
    MIN_WEIGHT_VERSION_HEADER,
    POOL_HEADER,
    ROUTING_KEY_HEADER,
    SESSION_MIN_WEIGHT_VERSION_KEY,
)
from miles.common.errors import MilesError
from miles.common.http_client import ENGINE_KEEPALIVE_EXPIRY_S, traced_async_client
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


class EngineClient:
    """One shared HTTP client to the upstream."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        max_connections: int,
        retry_after_s: float,
    ) -> None:
        self._retry_after_s = retry_after_s
        self._client = traced_async_client(
            base_url=base_url.rstrip("/"),
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            # The upstream may be an engine or a router served with uvicorn's 5 s keep-alive: drop idle
            # connections before it does.
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=ENGINE_KEEPALIVE_EXPIRY_S,
            ),
        )

    async def close(self) -> None:
        await self._client.aclose()

    def _request(
        self,
        *,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        stream: bool,
        routing_key: str,
        pool: str,
        routed_experts_start_len: int | None,
        lora_path: str | None,
        min_weight_version: int | None,
    ) -> httpx.Request:
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
        headers = {ROUTING_KEY_HEADER: routing_key, POOL_HEADER: pool}
        if min_weight_version is not None:
            headers[MIN_WEIGHT_VERSION_HEADER] = str(min_weight_version)
        return self._client.build_request("POST", "/generate", json=body, headers=headers)

    def _transport_error(self, exc: httpx.HTTPError) -> UpstreamUnavailableError:
        if isinstance(exc, httpx.TimeoutException):
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
            try:
                raw = await opened.response.aread()
            except httpx.HTTPError as exc:
                raise self._transport_error(exc) from exc
        finally:
            await opened.aclose()
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
        """The upstream's answer once its status is 200 (the body not read yet); the caller must `aclose()` it.
        A refusal (status, unreachable) raises here, before anything reached the agent."""
        request = self._request(
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
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        if response.status_code != 200:
            try:
                body = await response.aread()
            except httpx.HTTPError as exc:
                raise self._transport_error(exc) from exc
            finally:
                await response.aclose()
            self._raise_for_status(response.status_code, body, response.headers)
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
    requests), then `completion()` is the whole generation, checked as a non-streamed one. Transport failures while
    reading are UpstreamUnavailableError; `aclose()` closes the connection (an unfinished generation is aborted
    by the engine when its client goes away)."""

    def __init__(
        self,
        response: httpx.Response,
        *,
        num_prompt_tokens: int,
        started_s: float,
        on_error: Callable[[httpx.HTTPError], MilesError],
    ) -> None:
        self.response = response
        self._num_prompt_tokens = num_prompt_tokens
        self._started_s = started_s
        self._on_error = on_error
        self._state = StreamAccumulator()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._started_s

    async def token_ids(self) -> AsyncIterator[list[int]]:
        """The new sampled ids of each stream chunk (never empty), until the chunk with a finish_reason."""
        num_seen = 0
        try:
            async for line in self.response.aiter_lines():
                self._state.feed(line)
                if len(self._state.entries) > num_seen:
                    new_ids, _ = parse_entries(self._state.entries[num_seen:])
                    num_seen = len(self._state.entries)
                    yield new_ids
                if self._state.finished:
                    return
        except httpx.HTTPError as exc:
            raise self._on_error(exc) from exc

    def completion(self) -> Completion:
        """The finished generation (after `token_ids()` ended); UpstreamMalformedError when it never finished."""
        return parse_finished(
            self._state.final(),
            num_prompt_tokens=self._num_prompt_tokens,
            latency_s=self.elapsed_s(),
            entries=self._state.entries,
        )

    async def aclose(self) -> None:
        await self.response.aclose()
