"""The wire shape of SGLang's native /generate answer (docs/sglang-protocol.md §1.3-1.4) -> a Completion.

Owns parsing only (no HTTP): one finished answer object (`parse_finished`) or an SSE stream read line by line
(`StreamAccumulator`, cumulative or delta chunks: `completion_tokens` is always cumulative). The sampled ids come
from `meta_info.output_token_logprobs`, 3-element entries `[logprob, token_id, text|null]`; `finish_reason` is an
object `{type: stop|length|abort, matched?}`; an aborted generation is UpstreamAbortedError (503, retry), an engine
400 inside the answer UpstreamRejectedError, anything else malformed UpstreamMalformedError (502).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from miles.session.errors import (
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
    weight_version_spans: list[tuple[int, int, str]] | None = None
    """`meta_info.miles_weight_version_spans` (miles-engine): which weights sampled each output token, when a pause
    carried the request across an update; None from an engine that reports one version per call (SGLang)."""

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
            weight_version_spans=self.weight_version_spans,
        )


class UpstreamAbortedError(UpstreamUnavailableError):
    """The engine aborted the generation (e.g. a weight update); retrying the same request regenerates it."""

    code = "upstream_aborted"


def malformed(problem: str) -> UpstreamMalformedError:
    return UpstreamMalformedError(f"malformed /generate response from the upstream: {problem}")


def _logprob_entries(meta: Mapping[str, Any]) -> list[Any]:
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise malformed("meta_info.output_token_logprobs is missing (was return_logprob ignored?)")
    return entries


def parse_entries(entries: list[Any]) -> tuple[list[int], list[float | None]]:
    ids: list[int] = []
    logprobs: list[float | None] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, list | tuple) or len(entry) < 2:
            raise malformed(f"output_token_logprobs[{index}] is not a [logprob, token_id, text] entry")
        logprob, token_id = entry[0], entry[1]
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise malformed(f"output_token_logprobs[{index}] has token id {token_id!r}")
        if logprob is not None and (isinstance(logprob, bool) or not isinstance(logprob, int | float)):
            raise malformed(f"output_token_logprobs[{index}] has logprob {logprob!r}")
        ids.append(token_id)
        logprobs.append(None if logprob is None else float(logprob))
    return ids, logprobs


def _int_field(meta: Mapping[str, Any], name: str, default: int) -> int:
    value = meta.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise malformed(f"meta_info.{name} is {value!r}")
    return value


def parse_finished(
    body: Any, *, num_prompt_tokens: int, latency_s: float, entries: list[Any] | None = None
) -> Completion:
    """A Completion from the final /generate object (`entries`: logprob entries accumulated from a stream)."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise malformed("expected one JSON object with meta_info (batch responses are not used here)")
    meta: dict[str, Any] = body["meta_info"]
    ids, logprobs = parse_entries(entries if entries is not None else _logprob_entries(meta))
    completion_tokens = _int_field(meta, "completion_tokens", len(ids))
    if completion_tokens != len(ids):
        raise malformed(f"{len(ids)} output_token_logprobs entries for completion_tokens={completion_tokens}")
    output_ids = body.get("output_ids")
    if isinstance(output_ids, list) and len(output_ids) == len(ids) and output_ids != ids:
        raise malformed("output_ids disagree with output_token_logprobs")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        raise malformed(f"finish_reason {finish!r} is not an object with type stop|length|abort")
    if finish["type"] == "abort":
        message = finish.get("message") or "aborted"
        if finish.get("status_code") == 400:
            raise UpstreamRejectedError(f"the engine rejected the request: {message}")
        raise UpstreamAbortedError(f"the engine aborted the generation ({message}); retry", retry_after_s=1.0)
    if not ids:
        raise malformed("the engine returned no tokens")
    matched = finish.get("matched")
    routed = meta.get("routed_experts")
    if routed is not None and not isinstance(routed, str):
        raise malformed(f"meta_info.routed_experts is a {type(routed).__name__}, not a base64 string")
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
        weight_version_spans=_version_spans(meta, len(ids)),
    )


def _version_spans(meta: Mapping[str, Any], num_output_tokens: int) -> list[tuple[int, int, str]] | None:
    """`meta_info.miles_weight_version_spans`, checked: ordered, non-overlapping [start, end) within the output,
    each with a version label; None when absent or a single span (the turn's weight_version says it all)."""
    raw = meta.get("miles_weight_version_spans")
    if raw is None:
        return None
    spans: list[tuple[int, int, str]] = []
    previous_end = 0
    for span in raw if isinstance(raw, list) else [raw]:
        if not (isinstance(span, list) and len(span) == 3 and all(type(x) is int for x in span[:2])):
            raise malformed(f"meta_info.miles_weight_version_spans has {span!r}, not [start, end, version]")
        start, end = span[0], span[1]
        if not previous_end <= start < end <= num_output_tokens:
            raise malformed(f"meta_info.miles_weight_version_spans has [{start}, {end}) out of order or range")
        spans.append((start, end, str(span[2])))
        previous_end = end
    return spans if len(spans) > 1 else None


class StreamAccumulator:
    """The state of an SSE /generate stream read line by line: the logprob entries so far and the last chunk."""

    def __init__(self) -> None:
        self.entries: list[Any] = []
        self.last: dict[str, Any] | None = None
        self.finished = False

    def feed(self, line: str) -> None:
        """Take one line of the stream (`finished` once a chunk with a finish_reason or [DONE] was read)."""
        if not line.startswith("data:"):
            return
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.finished = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise malformed("a stream event is not JSON") from None
        if isinstance(chunk, dict) and "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
            if error.get("code") == 400:
                raise UpstreamRejectedError(f"the engine rejected the request: {error.get('message')}")
            raise UpstreamMalformedError(f"the upstream stream failed: {error.get('message')}")
        if not isinstance(chunk, dict) or not isinstance(chunk.get("meta_info"), dict):
            raise malformed("a stream event has no meta_info")
        new_entries = _logprob_entries(chunk["meta_info"])
        cumulative = chunk["meta_info"].get("completion_tokens")
        if isinstance(cumulative, int) and len(new_entries) == cumulative and len(new_entries) >= len(self.entries):
            self.entries = list(new_entries)  # cumulative chunks (SGLang's default)
        else:
            self.entries.extend(new_entries)  # delta chunks (--incremental-streaming-output)
        self.last = chunk
        if chunk["meta_info"].get("finish_reason") is not None:
            self.finished = True

    def final(self) -> dict[str, Any]:
        if self.last is None or self.last["meta_info"].get("finish_reason") is None:
            raise malformed("the stream ended before a chunk with a finish_reason")
        return self.last
