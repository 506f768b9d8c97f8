"""Export processes: a long session's GET and samples answered by a helper interpreter, not by the serving one.

Why: building a long session's answer (a 3M-token session: TITO's end-of-session check re-encodes its whole
history, every record is unpacked, ~100 MB of JSON is written) is seconds of CPU in this process, and however it
is sliced, pieces of it hold the GIL (a tokenizer's ids list, freeing big lists, the JSON pieces). Each such
hold delays every live turn of the replica. Measured by `make bench-session` on 2 cores: turn p99 during
repeated 100 MB GETs was 4-10x its idle p99 with the answer built in process, ~1.1x with it built in another
process reading the same Redis. So a linear session of at least `export_min_tokens` token ids is answered by one
of `export_processes` helpers (export_worker.py); this process only relays its bytes.

Protocol, over the helper's stdin and stdout: the server writes the settings (one JSON line, once), then one
`ViewRequest` JSON line per request; the helper answers with frames (1-byte kind, 4-byte big-endian length,
payload): `H` the head `{"status", "media_type", "headers"}`, `D` body pieces, and `E` `{"counters": [...]}`, the
metric increments the server adds to its own registry. An error before the body (session gone: 404, store down:
503) is a head with its status and the error body, exactly as the in-process answer. An error after the head
(`X`) cuts the answer: the client sees a truncated body, never a wrong one.
A helper answers one request at a time; a request waits for a free helper. One that dies, or whose answer was not
read to its end (the client went away), is killed and replaced on the next request; a request that finds no
working helper gets 503 `export_unavailable` with Retry-After. Only the Redis store can be shared with a helper:
with the memory store, and for tree sessions, every answer is built in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import sys
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from miles.session.errors import ExportUnavailableError
from miles.session.metrics import SessionMetrics
from miles.session.settings import SessionSettings
from miles.session.store import SessionStore
from miles.session.views import Rendered, SessionViews, ViewRequest

logger = logging.getLogger(__name__)

FRAME = struct.Struct(">cI")
HEAD, DATA, END, FAILED = b"H", b"D", b"E", b"X"
WORKER_MODULE = "miles.session.export_worker"
_READ_LIMIT_BYTES = 1 << 20


@dataclass
class Answer:
    """What the HTTP layer sends: status, media type, extra headers and the body in pieces."""

    status: int
    media_type: str
    body: AsyncIterator[bytes]
    headers: dict[str, str] = field(default_factory=dict)


def settings_line(settings: SessionSettings) -> bytes:
    """The settings as the helper's first stdin line (secrets included: a pipe to a child, not argv or env)."""
    data = settings.model_dump(mode="json")
    for name, value in settings:
        if isinstance(value, SecretStr):
            data[name] = value.get_secret_value()
    return json.dumps(data).encode() + b"\n"


class _Helper:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def frame(self) -> tuple[bytes, bytes]:
        assert self.process.stdout is not None
        kind, size = FRAME.unpack(await self.process.stdout.readexactly(FRAME.size))
        return kind, await self.process.stdout.readexactly(size) if size else b""

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


class ExportProcesses:
    """Decides where a read is built and, for long sessions, hands it to a helper process."""

    def __init__(self, settings: SessionSettings, views: SessionViews, metrics: SessionMetrics) -> None:
        self._settings_line = settings_line(settings)
        self._num_processes = settings.export_processes
        self._min_tokens = settings.export_min_tokens
        self._views = views
        self._metrics = metrics
        self._slots: asyncio.Queue[_Helper | None] | None = None
        self._helpers: set[_Helper] = set()

    async def answer(self, request: ViewRequest) -> Answer:
        """The answer to `request`: built here, or by a helper for a long linear session of a shared store."""
        if await self._exported(self._views.store, request):
            return await self._through_helper(request)
        rendered: Rendered = await self._views.render(request)
        return Answer(200, rendered.media_type, rendered.body)

    async def _exported(self, store: SessionStore, request: ViewRequest) -> bool:
        if not self._num_processes or not store.shared_across_processes or request.meta.tree:
            return False
        return await store.num_token_ids(request.meta.session_id) >= self._min_tokens

    @property
    def pids(self) -> list[int]:
        """Process ids of the running helpers."""
        return sorted(helper.process.pid for helper in self._helpers if helper.alive)

    async def close(self) -> None:
        for helper in list(self._helpers):
            helper.kill()
            with contextlib.suppress(ProcessLookupError):
                await helper.process.wait()
        self._helpers.clear()

    def _queue(self) -> asyncio.Queue[_Helper | None]:
        if self._slots is None:  # made on the serving loop, on first use
            self._slots = asyncio.Queue()
            for _ in range(self._num_processes):
                self._slots.put_nowait(None)
        return self._slots

    async def _spawn(self) -> _Helper:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            WORKER_MODULE,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=_READ_LIMIT_BYTES,
        )
        assert process.stdin is not None
        process.stdin.write(self._settings_line)
        helper = _Helper(process)
        self._helpers.add(helper)
        return helper

    def _release(self, helper: _Helper, *, reusable: bool) -> None:
        if not reusable:
            helper.kill()
            self._helpers.discard(helper)
        self._queue().put_nowait(helper if reusable else None)

    async def _through_helper(self, request: ViewRequest) -> Answer:
        helper = await self._queue().get()
        try:
            if helper is not None and not helper.alive:  # died while idle: replaced
                self._helpers.discard(helper)
                helper = None
            if helper is None:
                helper = await self._spawn()
            assert helper.process.stdin is not None
            helper.process.stdin.write(json.dumps(request.to_json()).encode() + b"\n")
            await helper.process.stdin.drain()
            kind, payload = await helper.frame()
            if kind != HEAD:
                raise ValueError(f"frame {kind!r} before the head")
            head = json.loads(payload)
        except BaseException as exc:
            if helper is None:
                self._queue().put_nowait(None)
            else:
                self._release(helper, reusable=False)
            if isinstance(exc, OSError | ValueError | asyncio.IncompleteReadError):
                message = f"the export process failed: {type(exc).__name__}: {exc}"
                raise ExportUnavailableError(message, retry_after_s=1.0) from exc
            raise
        return Answer(head["status"], head["media_type"], self._relay(helper), dict(head.get("headers") or {}))

    def _relay(self, helper: _Helper) -> AsyncIterator[bytes]:
        """The body's pieces. The helper goes back to the pool once the body is read to its end; a body that is
        abandoned, even one never started (its client went away before the head was sent), kills it."""
        released = False

        def release(reusable: bool) -> None:
            nonlocal released
            if not released:
                released = True
                self._release(helper, reusable=reusable)

        body = self._frames(helper, release)
        weakref.finalize(body, release, False)
        return body

    async def _frames(self, helper: _Helper, release: Callable[[bool], None]) -> AsyncIterator[bytes]:
        complete = False
        try:
            while True:
                kind, payload = await helper.frame()
                if kind == DATA:
                    yield payload
                elif kind == END:
                    self._apply_counters(json.loads(payload)["counters"])
                    complete = True
                    return
                else:
                    message = f"the export process failed mid-answer: {payload.decode(errors='replace')[:500]}"
                    raise ExportUnavailableError(message, retry_after_s=1.0)
        except asyncio.IncompleteReadError as exc:
            raise ExportUnavailableError("the export process exited mid-answer", retry_after_s=1.0) from exc
        finally:
            release(complete)

    def _apply_counters(self, counters: list[dict[str, Any]]) -> None:
        for entry in counters:
            counter = self._metrics.exported_counter(entry["name"])
            if counter is not None and entry["value"] > 0:
                labels = entry["labels"]
                (counter.labels(**labels) if labels else counter).inc(entry["value"])
