"""Relays one engine's SSE answer to the client chunk by chunk, and always cleans up after it.

`StreamRelay` is what the HTTP layer iterates. Whether the stream ends normally, breaks (the engine died: the
client gets one SGLang-style error event and `data: [DONE]`, since a started stream cannot be retried), or is
abandoned (client disconnect, or never started), `aclose()` runs exactly once: it closes the engine response and
reports a `StreamEnd` (release the slot, record the outcome and counts). The HTTP layer calls `aclose()` in a
`finally`, so a slot is never leaked even when the body is never iterated.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from miles.router.response_meta import ResponseMeta, SseTail


@dataclass(frozen=True)
class StreamEnd:
    status_code: int
    finished: bool
    """The engine ended the body normally."""
    broken: bool
    """The engine connection failed mid-stream."""
    meta: ResponseMeta | None
    """Counts read from the last data event (None when not readable)."""


class StreamRelay:
    def __init__(
        self,
        response: httpx.Response,
        chunks: AsyncIterator[bytes],
        first: bytes,
        on_end: Callable[[StreamEnd], None],
    ) -> None:
        self.response = response
        self.status_code = response.status_code
        self._chunks = chunks
        self._first = first
        self._on_end = on_end
        self._tail = SseTail()
        self._finished = False
        self._broken = False
        self._closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[bytes]:
        try:
            try:
                if self._first:
                    self._tail.feed(self._first)
                    yield self._first
                async for chunk in self._chunks:
                    self._tail.feed(chunk)
                    yield chunk
                self._finished = True
            except httpx.TransportError as exc:
                self._broken = True
                yield stream_error_event(str(self.response.request.url), exc, self._tail.at_event_boundary)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close the engine response and report how the stream ended; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.response.aclose()
        finally:
            readable = self._finished and self.status_code == 200 and is_plain(self.response)
            self._on_end(
                StreamEnd(
                    status_code=self.status_code,
                    finished=self._finished,
                    broken=self._broken,
                    meta=self._tail.meta() if readable else None,
                )
            )


def is_plain(response: httpx.Response) -> bool:
    """True when the body is not content-encoded (so the router can read counts from it)."""
    return response.headers.get("content-encoding", "identity") in ("", "identity")


def stream_error_event(url: str, exc: Exception, at_boundary: bool) -> bytes:
    """The SGLang mid-stream error event (docs/sglang-protocol.md §1.4) followed by [DONE]."""
    error = {
        "error": {
            "message": f"engine connection broke mid-stream ({url}): {type(exc).__name__}: {exc}",
            "type": "engine_stream_broken",
            "code": 502,
            "retryable": True,
        }
    }
    prefix = b"" if at_boundary else b"\n\n"
    return prefix + b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
