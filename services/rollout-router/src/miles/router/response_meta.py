"""What the router reads from engine answers (never changing the bytes it passes on).

- `/generate`: `meta_info.prompt_tokens`, `meta_info.cached_tokens`, `meta_info.weight_version` (a batch answer is
  a JSON array: tokens are summed), plus `output_ids`/`text` so the prefix tree can learn what the engine caches
  after the turn.
- OpenAI routes: `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens` (SGLang fills the latter
  only with --enable-cache-report).
- Streams: the last `data:` event before `data: [DONE]` (cumulative in SGLang's default mode), kept by `SseTail`
  while the raw chunks pass through.

Limits: for an interleaved n>1 / batch stream only the last event is read (one sub-request's counts); output ids
of a delta-mode stream (SGLang --incremental-streaming-output) are not learned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from miles.common.contracts.weight_version import parse_weight_version
from miles.router.radix import encode_code_points, encode_token_ids
from miles.router.routing_input import ROUTE_GENERATE, RoutingInput

_DONE = b"[DONE]"


@dataclass(frozen=True)
class ResponseMeta:
    num_prompt_tokens: int
    num_cached_tokens: int
    weight_version: int | None
    output_ids: list[int] | None
    """Cumulative output ids of a single /generate answer (None for batches and OpenAI routes)."""
    output_text: str | None


def meta_from_body(body: bytes) -> ResponseMeta | None:
    """Counts of a complete JSON answer; None when it is not a generate/OpenAI answer (e.g. an error body)."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return meta_from_payload(payload)


def meta_from_payload(payload: object) -> ResponseMeta | None:
    if isinstance(payload, list):
        metas = [meta for item in payload if (meta := meta_from_payload(item)) is not None]
        if not metas:
            return None
        versions = [meta.weight_version for meta in metas if meta.weight_version is not None]
        return ResponseMeta(
            num_prompt_tokens=sum(meta.num_prompt_tokens for meta in metas),
            num_cached_tokens=sum(meta.num_cached_tokens for meta in metas),
            weight_version=max(versions) if versions else None,
            output_ids=None,
            output_text=None,
        )
    if not isinstance(payload, dict):
        return None
    meta_info = payload.get("meta_info")
    if isinstance(meta_info, dict):
        return _generate_meta(payload, meta_info)
    usage = payload.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return ResponseMeta(_count(usage.get("prompt_tokens")), _count(cached), None, None, None)
    return None


def _generate_meta(payload: dict[str, Any], meta_info: dict[str, Any]) -> ResponseMeta:
    output_ids = payload.get("output_ids")
    completion_tokens = meta_info.get("completion_tokens")
    cumulative = isinstance(output_ids, list) and (
        not isinstance(completion_tokens, int) or len(output_ids) == completion_tokens
    )
    text = payload.get("text")
    return ResponseMeta(
        num_prompt_tokens=_count(meta_info.get("prompt_tokens")),
        num_cached_tokens=_count(meta_info.get("cached_tokens")),
        weight_version=parse_weight_version(meta_info.get("weight_version")),
        output_ids=output_ids if cumulative else None,
        output_text=text if isinstance(text, str) else None,
    )


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def continuation_key(request: RoutingInput, meta: ResponseMeta) -> bytes:
    """What the engine caches beyond the prompt after answering (SGLang keeps prompt + output[:-1]), encoded like
    the request's prefix key; b"" when unknown."""
    if request.route != ROUTE_GENERATE or not request.prefix_key:
        return b""
    if request.is_token_key:
        if not meta.output_ids or len(meta.output_ids) < 2:
            return b""
        return encode_token_ids(meta.output_ids[:-1]) or b""
    return encode_code_points(meta.output_text) if meta.output_text else b""


class SseTail:
    """Follows a `text/event-stream` body chunk by chunk and keeps its last data event (other than [DONE])."""

    def __init__(self) -> None:
        self._pending = b""
        self.last_event: bytes | None = None
        self.saw_done = False
        self.bytes_seen = 0

    def feed(self, chunk: bytes) -> None:
        self.bytes_seen += len(chunk)
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return
        self._pending = data[end + 2 :]
        for event in reversed(data[:end].split(b"\n\n")):
            payload = _event_data(event)
            if payload is None:
                continue
            if payload == _DONE:
                self.saw_done = True
                continue
            self.last_event = payload
            break

    @property
    def at_event_boundary(self) -> bool:
        """True when the bytes so far end between events (an error event may be appended cleanly)."""
        return not self._pending

    def meta(self) -> ResponseMeta | None:
        if self.last_event is None:
            return None
        return meta_from_body(self.last_event)


def _event_data(event: bytes) -> bytes | None:
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
