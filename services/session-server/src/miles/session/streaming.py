"""A streamed turn (`stream: true`) passed through as the engine generates it, committed when its stream ends.

`StreamingTurns.open` runs phase 1 (turns.py) and opens a streamed /generate; every refusal up to the engine's
answer status (bad input, 4xx/5xx, unreachable, a LoRA adapter the engine no longer has: retried once) is an HTTP
error as for a non-streamed turn. From then on the agent gets `chat.completion.chunk`s: the role at once, then
reasoning and content text as tokens arrive (only what is certain to be a prefix of the final message:
stream_text.py), and when the engine's stream ends the turn is checked and committed exactly as a non-streamed one
(`TurnRunner.finish`: the same ids, logprobs, weight_version, routing rows, TITO records), after which the rest of
the message (held-back text, parsed `tool_calls`), the finish chunk with `miles`, the optional usage chunk and
`data: [DONE]` follow. Routing rows (`meta_info.routed_experts`) come on the engine's last chunk and are only
ever handed to phase 3; no chunk carries them.

Failures after the first chunk cannot change the status any more: a failed upstream (broken connection, an error
event, an aborted or malformed generation) or a refused check / commit ends the stream with
`data: {"error": {...}}` (the same object as an HTTP error body) and `data: [DONE]`; nothing is recorded, and the
metrics count it (`turns{result="failed"}`, `turn_errors`, `upstream_errors`, `stream_interruptions`). The agent
retries the same request, as after a 503.
A client that disconnects mid-stream: the upstream request is closed (the engine aborts the generation) and the
turn is not committed, because an agent that never read the answer cannot resend it, and a recorded turn the agent
does not know about would only be rolled back by its next request. A disconnect during the commit itself may
leave the turn recorded (the commit is atomic; either way the next request rolls back or appends consistently).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from miles.common.errors import MilesError
from miles.session.adapters import JobAdapters, served_with
from miles.session.api_models import ChatCompletionRequest
from miles.session.metrics import SessionMetrics
from miles.session.openai_format import budget_headers
from miles.session.records import Json, LiveAdapter
from miles.session.stream_text import SafeParts, StreamedMessage
from miles.session.turns import PreparedTurn, TurnRunner, TurnStart
from miles.session.upstream import Completion, EngineClient, UpstreamStream

tracer = trace.get_tracer("miles.session")
DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(data: Json) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class StreamingTurns:
    """Opens streamed turns over the TurnRunner's phases 1 and 3."""

    def __init__(
        self, *, turns: TurnRunner, engine: EngineClient, adapters: JobAdapters, metrics: SessionMetrics
    ) -> None:
        self._turns = turns
        self._engine = engine
        self._adapters = adapters
        self._metrics = metrics

    async def open(self, start: TurnStart, request: ChatCompletionRequest) -> TurnStream:
        """The turn's stream, once the engine answered 200 (MilesError for every refusal before that)."""
        started_s = time.perf_counter()
        try:
            turn = await self._turns.prepare(start, request)
            upstream, adapter = await self._open_upstream(turn)
        except MilesError as exc:
            self._turns.count_failure(exc)
            raise
        return TurnStream(self._turns, self._metrics, turn, upstream, adapter, started_s)

    async def _open_upstream(self, turn: PreparedTurn) -> tuple[UpstreamStream, LiveAdapter | None]:
        args = self._turns.upstream_args(turn)

        async def call(lora_path: str | None) -> UpstreamStream:
            return await self._engine.open_stream(**args, stream=True, lora_path=lora_path)

        meta = turn.meta
        try:
            adapter = await self._adapters.wait_live(meta.job_id) if meta.model.lora_adapter else None
            if adapter is None:
                return await call(None), None
            return await self._adapters.call_live(meta.job_id, adapter, call)
        except MilesError as exc:
            self._turns.count_upstream_error(exc)
            raise


@dataclass
class _Chunks:
    """The `chat.completion.chunk` envelope of one stream."""

    completion_id: str
    created: int
    model: str

    def delta(self, delta: Json, finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        base = {"id": self.completion_id, "object": "chat.completion.chunk", "created": self.created}
        return sse_event({**base, "model": self.model, "choices": [choice], **extra})

    def text(self, parts: SafeParts) -> list[bytes]:
        events = []
        if parts.reasoning:
            events.append(self.delta({"reasoning_content": parts.reasoning}))
        if parts.content:
            events.append(self.delta({"content": parts.content}))
        return events


class TurnStream:
    """One open streamed turn: `events()` is the SSE body (iterate it once)."""

    def __init__(
        self,
        turns: TurnRunner,
        metrics: SessionMetrics,
        turn: PreparedTurn,
        upstream: UpstreamStream,
        adapter: LiveAdapter | None,
        started_s: float,
    ) -> None:
        self._turns = turns
        self._metrics = metrics
        self._turn = turn
        self._upstream = upstream
        self._adapter = adapter
        self._started_s = started_s
        self._upstream_failed = False
        request = turn.request
        self._chunks = _Chunks(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), request.model or turn.model.name)
        self._message = StreamedMessage(
            turn.model.tito, reasoning_open=turn.plan.prompt.reasoning_open, stop=request.stop
        )
        self.headers = budget_headers(
            {
                "miles": {
                    "max_new_tokens": turn.budget.max_new_tokens,
                    "max_tokens_clamped_from": turn.budget.clamped_from,
                }
            }
        )

    async def events(self) -> AsyncIterator[bytes]:
        body: Json | None = None
        try:
            yield self._chunks.delta({"role": "assistant", "content": ""})
            async for event in self._relay():
                yield event
            body = await self._turns.finish(self._turn, self._completion(), completion_id=self._chunks.completion_id)
        except MilesError as exc:
            self._turns.count_failure(exc)
            reason = "upstream_error" if self._upstream_failed else "failed"
            self._metrics.stream_interruptions.labels(reason=reason).inc()
            yield sse_event({"error": exc.to_dict()})
            yield DONE_EVENT
            return
        except (asyncio.CancelledError, GeneratorExit):
            self._metrics.stream_interruptions.labels(reason="client_disconnect").inc()
            raise
        finally:
            self._upstream.close()
        for event in self._ending(body):
            yield event
        self._turns.count_answered(body, self._started_s)

    async def _relay(self) -> AsyncIterator[bytes]:
        """The text deltas while the engine generates (upstream failures counted and raised)."""
        span = tracer.start_span("session.upstream", attributes=self._turn.attributes)
        first_token = True
        try:
            async for ids in self._upstream.token_ids():
                events = self._chunks.text(self._message.advance(ids))
                if events and first_token:
                    first_token = False
                    self._metrics.stream_first_token_s.observe(time.perf_counter() - self._started_s)
                for event in events:
                    yield event
        except MilesError as exc:
            self._turns.count_upstream_error(exc)
            self._upstream_failed = True
            raise
        finally:
            span.end()

    def _completion(self) -> Completion:
        try:
            completion = self._upstream.completion()
        except MilesError as exc:
            self._turns.count_upstream_error(exc)
            self._upstream_failed = True
            raise
        return served_with(completion, self._adapter) if self._adapter is not None else completion

    def _ending(self, body: Json) -> list[bytes]:
        """The rest of the message, the finish chunk (with `miles`), the optional usage chunk and [DONE]."""
        choice = body["choices"][0]
        message: Json = choice["message"]
        rest = self._message.rest(message.get("reasoning_content"), message.get("content") or "")
        if rest is None:
            self._metrics.stream_divergences.inc()
            rest = SafeParts("", "")
        events = self._chunks.text(rest)
        for index, call in enumerate(message.get("tool_calls", [])):
            events.append(self._chunks.delta({"tool_calls": [{"index": index, **call}]}))
        events.append(self._chunks.delta({}, choice["finish_reason"], miles=body["miles"]))
        if self._turn.request.include_usage:
            base = {"id": self._chunks.completion_id, "object": "chat.completion.chunk"}
            events.append(
                sse_event(
                    {
                        **base,
                        "created": self._chunks.created,
                        "model": self._chunks.model,
                        "choices": [],
                        "usage": body["usage"],
                    }
                )
            )
        events.append(DONE_EVENT)
        return events
