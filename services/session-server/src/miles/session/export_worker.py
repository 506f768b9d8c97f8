"""The export process (`python -m miles.session.export_worker`): builds long sessions' GET and samples answers for
the session server that started it, on its own interpreter and GIL (why, and the protocol: exports.py).

It reads the settings line, then one request per line from stdin, and writes frames to stdout; it exits when stdin
closes (its server went away). Logs go to stderr, which it shares with its server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from typing import Any, BinaryIO

from miles.common.errors import MilesError
from miles.common.http import error_response
from miles.common.logs import configure_logging
from miles.common.telemetry import Metrics
from miles.session.exports import DATA, END, FAILED, FRAME, HEAD
from miles.session.metrics import SessionMetrics, counter_increments
from miles.session.model_assets import ModelRegistry
from miles.session.settings import SessionSettings
from miles.session.store import make_store
from miles.session.views import SessionViews, ViewRequest

logger = logging.getLogger(__name__)

FRAME_BYTES = 256 * 1024
"""Body pieces are gathered up to this size per frame: this process has no live turns to yield to."""


def _write(out: BinaryIO, kind: bytes, payload: bytes) -> None:
    out.write(FRAME.pack(kind, len(payload)))
    out.write(payload)


def _head(status: int, media_type: str, headers: dict[str, str] | None = None) -> bytes:
    return json.dumps({"status": status, "media_type": media_type, "headers": headers or {}}).encode()


async def _answer(views: SessionViews, metrics: SessionMetrics, line: bytes, out: BinaryIO) -> None:
    """One request: head, body frames, end (or an error head with its body)."""
    before = metrics.exported_values()
    try:
        rendered = await views.render(ViewRequest.from_json(json.loads(line)))
    except Exception as exc:  # a MilesError is its own answer; anything else is a bug: 500, as in process
        if not isinstance(exc, MilesError):
            logger.exception("export failed")
            exc = MilesError(f"the export failed: {type(exc).__name__}")
        response = error_response(exc)
        headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
        _write(out, HEAD, _head(response.status_code, "application/json", headers))
        _write(out, DATA, bytes(response.body))
        _write(out, END, json.dumps({"counters": []}).encode())
        out.flush()
        return
    _write(out, HEAD, _head(200, rendered.media_type))
    pending: list[bytes] = []
    size = 0
    try:
        async for piece in rendered.body:
            pending.append(piece)
            size += len(piece)
            if size >= FRAME_BYTES:
                _write(out, DATA, b"".join(pending))
                pending, size = [], 0
    except Exception as exc:  # a bug or the store failing mid-body: the server cuts the answer
        logger.exception("export failed mid-answer")
        _write(out, FAILED, f"{type(exc).__name__}: {exc}".encode())
        out.flush()
        return
    if pending:
        _write(out, DATA, b"".join(pending))
    counters: list[dict[str, Any]] = counter_increments(before, metrics.exported_values())
    _write(out, END, json.dumps({"counters": counters}).encode())
    out.flush()


async def serve(settings: SessionSettings, requests: asyncio.StreamReader, out: BinaryIO) -> None:
    """Answer requests until `requests` ends."""
    metrics = SessionMetrics(Metrics("session"))
    store = make_store(settings)
    views = SessionViews(store=store, models=ModelRegistry(settings.model_cache_size), metrics=metrics)
    try:
        while line := await requests.readline():
            await _answer(views, metrics, line, out)
    finally:
        await store.close()


async def _main() -> None:
    loop = asyncio.get_running_loop()
    requests = asyncio.StreamReader(limit=64 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(requests), sys.stdin)
    first = await requests.readline()
    if not first:
        return
    settings = SessionSettings(**json.loads(first))
    frames = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not land between frames
    configure_logging("session", settings.log_level, json_lines=settings.log_json)
    with frames:
        await serve(settings, requests, frames)


if __name__ == "__main__":
    asyncio.run(_main())
