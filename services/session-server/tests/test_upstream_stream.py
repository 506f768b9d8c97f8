"""The upstream answer's line splitting (aiohttp's own readline refuses lines over its buffer, and SGLang's
cumulative chunks grow with the completion): lines cut anywhere by the transport come out whole, CRLF or LF."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from miles.session.upstream import UpstreamStream


def stream_of(chunks: list[bytes]) -> UpstreamStream:
    async def iter_any() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    response: Any = SimpleNamespace(content=SimpleNamespace(iter_any=iter_any))
    return UpstreamStream(response, num_prompt_tokens=1, started_s=time.perf_counter(), on_error=lambda exc: exc)


async def lines_of(chunks: list[bytes]) -> list[str]:
    return [line async for line in stream_of(chunks)._lines()]


async def test_lines_cut_anywhere_come_out_whole() -> None:
    chunks = [b'data: {"a"', b": 1}\r\n", b"\ndata: x", b"y\n\n", b"data: [DONE]"]
    assert await lines_of(chunks) == ['data: {"a": 1}', "", "data: xy", "", "data: [DONE]"]
    assert await lines_of([b"one\ntwo\nthree\n"]) == ["one", "two", "three"]
    assert await lines_of([]) == []


@pytest.mark.parametrize("piece_bytes", [7, 1024, 1_000_000])
async def test_a_line_longer_than_any_buffer_is_one_line(piece_bytes: int) -> None:
    line = b"data: " + b"7" * 300_000
    body = line + b"\n\n"
    chunks = [body[i : i + piece_bytes] for i in range(0, len(body), piece_bytes)]
    assert await lines_of(chunks) == [line.decode(), ""]
