"""The upstream call: SGLang-native `POST /generate` on the rollout router (or one engine), parsed into a Completion.

Request: `input_ids`, `sampling_params`, `return_logprob: true`, `stream` when the client streams, headers
`X-SMG-Routing-Key: <session_id>` (KV-cache affinity) and `X-Miles-Pool: <engine pool>`; for a session that records
routing also `return_routed_experts: true` and `routed_experts_start_len` (sglang-protocol.md §1.6: the answer's
`meta_info.routed_experts`, on the final chunk when streaming, is kept raw in the Completion); for a LoRA job's turn
`lora_path` (the job's live adapter, adapters.py); for a session whose metadata has `min_weight_version` (an
evaluation episode pinned to a version) the `X-Miles-Min-Weight-Version` header. The body is built field by field
here: nothing of the agent's request passes through except the sampling parameters openai_format picks. Response
(docs/sglang-protocol.md §1.3-1.4): the sampled ids come from `meta_info.output_token_logprobs`, 3-element
entries `[logprob, token_id, text|null]`; `finish_reason` is an object `{type: stop|length|abort, matched?}`.
Streaming tolerates both cumulative and delta chunks (the rule: `completion_tokens` is always cumulative).

Errors: unreachable, timed out, 5xx/429 or an aborted generation -> 503 with Retry-After (nothing recorded, the
agent retries the same request); 400 -> 400 with the engine's message; 409 -> 409; anything malformed -> 502.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from miles.common.contracts.headers import (
    MIN_WEIGHT_VERSION_HEADER,
    POOL_HEADER,
    ROUTING_KEY_HEADER,
    SESSION_MIN_WEIGHT_VERSION_KEY,
)
from miles.common.http_client import ENGINE_KEEPALIVE_EXPIRY_S, traced_async_client
from miles.session.errors import (
    UpstreamConflictError,
    UpstreamMalformedError,
    UpstreamRejectedError,
    UpstreamUnavailableError,
)
from miles.session.records import FinishType, TurnRecord


@dataclass(frozen=True)
class Completion:
    """One generation as the engine reported it."""

    output_ids: list[int]
    logprobs: list[float | None]
    finish_type: FinishType
    finish_matched: int | str | None
    weight_version: str
    cached_tokens: int
    prompt_tokens: int
    latency_s: float
    routed_experts: str | None = None
    """`meta_info.routed_experts` as sent (base64 of little-endian int32), when asked for; routing.py checks it.
    Never part of the agent's answer."""

    def record(
        self,
        *,
        turn_index: int,
        prompt_len: int,
        num_trimmed_tokens: int,
        messages_end: int,
        routing_start_row: int | None,
    ) -> TurnRecord:
        """The TurnRecord that commits this generation at `turn_index` of its session (or tree path)."""
        return TurnRecord(
            turn_index=turn_index,
            prompt_len=prompt_len,
            num_trimmed_tokens=num_trimmed_tokens,
            completion_ids=self.output_ids,
            logprobs=self.logprobs,
            weight_version=self.weight_version,
            cached_tokens=self.cached_tokens,
            prompt_tokens=self.prompt_tokens,
            finish_type=self.finish_type,
            finish_matched=self.finish_matched,
            messages_end=messages_end,
            created_at_unix_ms=int(time.time() * 1000),
            upstream_latency_s=self.latency_s,
            routing_start_row=routing_start_row,
        )


def pinned_weight_version(metadata: Mapping[str, Any]) -> int | None:
    """The `min_weight_version` a session's metadata pins its turns to (an int >= 0; anything else: none)."""
    value = metadata.get(SESSION_MIN_WEIGHT_VERSION_KEY)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


class UpstreamAbortedError(UpstreamUnavailableError):
    """The engine aborted the generation (e.g. a weight update); retrying the same request regenerates it."""

    code = "upstream_aborted"


def _malformed(problem: str) -> UpstreamMalformedError:
    return UpstreamMalformedError(f"malformed /generate response from the upstream: {problem}")


def _logprob_entries(meta: Mapping[str, Any]) -> list[Any]:
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise _malformed("meta_info.output_token_logprobs is missing (was return_logprob ignored?)")
    return entries


def _parse_entries(entries: list[Any]) -> tuple[list[int], list[float | None]]:
    ids: list[int] = []
    logprobs: list[float | None] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, list | tuple) or len(entry) < 2:
            raise _malformed(f"output_token_logprobs[{index}] is not a [logprob, token_id, text] entry")
        logprob, token_id = entry[0], entry[1]
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise _malformed(f"output_token_logprobs[{index}] has token id {token_id!r}")
        if logprob is not None and (isinstance(logprob, bool) or not isinstance(logprob, int | float)):
            raise _malformed(f"output_token_logprobs[{index}] has logprob {logprob!r}")
        ids.append(token_id)
        logprobs.append(None if logprob is None else float(logprob))
    return ids, logprobs


def _int_field(meta: Mapping[str, Any], name: str, default: int) -> int:
    value = meta.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _malformed(f"meta_info.{name} is {value!r}")
    return value


def parse_finished(
    body: Any, *, num_prompt_tokens: int, latency_s: float, entries: list[Any] | None = None
) -> Completion:
    """A Completion from the final /generate object (`entries`: logprob entries accumulated from a stream)."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise _malformed("expected one JSON object with meta_info (batch responses are not used here)")
    meta: dict[str, Any] = body["meta_info"]
    ids, logprobs = _parse_entries(entries if entries is not None else _logprob_entries(meta))
    completion_tokens = _int_field(meta, "completion_tokens", len(ids))
    if completion_tokens != len(ids):
        raise _malformed(f"{len(ids)} output_token_logprobs entries for completion_tokens={completion_tokens}")
    output_ids = body.get("output_ids")
    if isinstance(output_ids, list) and len(output_ids) == len(ids) and output_ids != ids:
        raise _malformed("output_ids disagree with output_token_logprobs")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        raise _malformed(f"finish_reason {finish!r} is not an object with type stop|length|abort")
    if finish["type"] == "abort":
        message = finish.get("message") or "aborted"
        if finish.get("status_code") == 400:
            raise UpstreamRejectedError(f"the engine rejected the request: {message}")
        raise UpstreamAbortedError(f"the engine aborted the generation ({message}); retry", retry_after_s=1.0)
    if not ids:
        raise _malformed("the engine returned no tokens")
    matched = finish.get("matched")
    routed = meta.get("routed_experts")
    if routed is not None and not isinstance(routed, str):
        raise _malformed(f"meta_info.routed_experts is a {type(routed).__name__}, not a base64 string")
    return Completion(
        output_ids=ids,
        logprobs=logprobs,
        finish_type=FinishType(finish["type"]),
        finish_matched=matched if isinstance(matched, int | str) and not isinstance(matched, bool) else None,
        weight_version=str(meta.get("weight_version", "")),
        cached_tokens=_int_field(meta, "cached_tokens", 0),
        prompt_tokens=_int_field(meta, "prompt_tokens", num_prompt_tokens),
        latency_s=latency_s,
        routed_experts=routed,
    )


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
        started_s = time.perf_counter()
        try:
            async with self._client.stream("POST", "/generate", json=body, headers=headers) as response:
                if response.status_code != 200:
                    self._raise_for_status(response.status_code, await response.aread(), response.headers)
                if stream:
                    final, entries = await _read_stream(response.aiter_lines())
                    return parse_finished(
                        final,
                        num_prompt_tokens=len(input_ids),
                        latency_s=time.perf_counter() - started_s,
                        entries=entries,
                    )
                raw = await response.aread()
        except httpx.TimeoutException as exc:
            raise UpstreamUnavailableError(
                f"the upstream did not answer in time ({type(exc).__name__})", retry_after_s=self._retry_after_s
            ) from exc
        except httpx.TransportError as exc:
            raise UpstreamUnavailableError(
                f"the upstream is unreachable ({type(exc).__name__}: {exc})", retry_after_s=self._retry_after_s
            ) from exc
        try:
            parsed = json.loads(raw)
        except ValueError:
            raise _malformed("the body is not JSON") from None
        return parse_finished(parsed, num_prompt_tokens=len(input_ids), latency_s=time.perf_counter() - started_s)

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


async def _read_stream(lines: AsyncIterator[str]) -> tuple[dict[str, Any], list[Any]]:
    """(the last chunk, the accumulated logprob entries) of an SSE /generate stream."""
    entries: list[Any] = []
    last: dict[str, Any] | None = None
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            raise _malformed("a stream event is not JSON") from None
        if isinstance(chunk, dict) and "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
            if error.get("code") == 400:
                raise UpstreamRejectedError(f"the engine rejected the request: {error.get('message')}")
            raise UpstreamMalformedError(f"the upstream stream failed: {error.get('message')}")
        if not isinstance(chunk, dict) or not isinstance(chunk.get("meta_info"), dict):
            raise _malformed("a stream event has no meta_info")
        new_entries = _logprob_entries(chunk["meta_info"])
        cumulative = chunk["meta_info"].get("completion_tokens")
        if isinstance(cumulative, int) and len(new_entries) == cumulative and len(new_entries) >= len(entries):
            entries = list(new_entries)  # cumulative chunks (SGLang's default)
        else:
            entries.extend(new_entries)  # delta chunks (--incremental-streaming-output)
        last = chunk
        if chunk["meta_info"].get("finish_reason") is not None:
            break
    if last is None or last["meta_info"].get("finish_reason") is None:
        raise _malformed("the stream ended before a chunk with a finish_reason")
    return last, entries
