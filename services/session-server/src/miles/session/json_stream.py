"""Large JSON answers written piece by piece, so that they do not hold the event loop (head-of-line blocking).

A session's `GET` can be ~100 MB of JSON (token ids, every record's ids and logprobs, the history). `json.dumps`
of it holds the GIL, and with it the event loop of every live turn of this replica, for its whole run, wherever
it runs (a worker thread does not help a C call that never releases the GIL), and FastAPI's `jsonable_encoder`
would first walk every element in Python on the loop. Here the value is encoded one bounded piece at a time (a
list of scalars in slices of SLICE_ITEMS, a long string in slices of STRING_SLICE_CHARS, a dict key by key) and the
loop is handed back after every ~PIECE_BYTES, so a live turn waits for one piece, not for the whole body. Each step
of a live turn can wait for one piece (a turn takes ~10 loop iterations): at 64 KB pieces a turn during a big GET
took a median 68 ms instead of 7; at 16 KB, 15 ms.
The output is the JSON Starlette's JSONResponse writes (compact separators, UTF-8, NaN refused).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

SLICE_ITEMS = 2048
PIECE_BYTES = 16 * 1024
STRING_SLICE_CHARS = 16 * 1024


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _is_container(value: Any) -> bool:
    return isinstance(value, dict | list | tuple)


def encode_pieces(value: Any) -> Iterator[str]:
    """The JSON text of `value` in pieces that each cost a bounded amount of work."""
    if isinstance(value, dict):
        yield "{"
        for index, (key, item) in enumerate(value.items()):
            yield ("," if index else "") + _dumps(str(key)) + ":"
            yield from encode_pieces(item)
        yield "}"
    elif isinstance(value, list | tuple):
        yield "["
        if value and not _is_container(value[0]):  # scalars (our arrays are homogeneous): C-speed slices
            for start in range(0, len(value), SLICE_ITEMS):
                yield ("," if start else "") + _dumps(value[start : start + SLICE_ITEMS])[1:-1]
        else:
            for index, item in enumerate(value):
                if index:
                    yield ","
                yield from encode_pieces(item)
        yield "]"
    elif isinstance(value, str) and len(value) > STRING_SLICE_CHARS:  # a long message: JSON escapes per character
        yield '"'
        for start in range(0, len(value), STRING_SLICE_CHARS):
            yield _dumps(value[start : start + STRING_SLICE_CHARS])[1:-1]
        yield '"'
    else:
        yield _dumps(value)


RELEASE_SLICE_ITEMS = 65536
"""Big lists are emptied this many items at a time. Freeing a 3M-element list is one C call (~28 ms with the GIL
held, in any thread), and a long session's view holds ~15M ids and logprobs: dropped at once, that is a ~100 ms
stall of every live turn of the replica at the end of each GET."""


def release_in_slices(items: list[Any]) -> None:
    """Empty `items` (a list only its caller holds) from the end, RELEASE_SLICE_ITEMS at a time: each `del` is one
    bounded C call, and between them another thread can take the GIL."""
    while items:
        del items[-RELEASE_SLICE_ITEMS:]


async def release_on_loop(lists: Sequence[list[Any]]) -> None:
    """`release_in_slices` on the event loop, handing it back after every slice."""
    for items in lists:
        while items:
            del items[-RELEASE_SLICE_ITEMS:]
            await asyncio.sleep(0)


async def json_body(value: Any, *, release: Sequence[list[Any]] = ()) -> AsyncIterator[bytes]:
    """`value` as UTF-8 JSON chunks of about PIECE_BYTES, yielding to the event loop between them; then the lists
    in `release` (the value's big lists that only it holds) are emptied in slices."""
    buffer: list[str] = []
    size = 0
    for piece in encode_pieces(value):
        buffer.append(piece)
        size += len(piece)
        if size >= PIECE_BYTES:
            yield "".join(buffer).encode()
            buffer, size = [], 0
            await asyncio.sleep(0)  # a send to an unpaused transport does not suspend: let live turns run
    if buffer:
        yield "".join(buffer).encode()
    await release_on_loop(release)


_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def loads_array_in_pieces(data: bytes | str) -> list[Any]:
    """`json.loads` of a JSON array, one element per call: a long session's stored history (~10 MB of message
    text) parsed in one call holds the GIL throughout; element by element, no call is longer than one message."""
    text = data.decode() if isinstance(data, bytes) else data
    start = len(text) - len(text.lstrip(_WHITESPACE))
    if not text.startswith("[", start):
        return list(json.loads(text))  # not an array: json.loads' own error or value
    items: list[Any] = []
    index = start + 1
    while True:
        while index < len(text) and text[index] in _WHITESPACE:
            index += 1
        if text.startswith("]", index) and not items:
            index += 1
            break
        item, index = _DECODER.raw_decode(text, index)
        items.append(item)
        while index < len(text) and text[index] in _WHITESPACE:
            index += 1
        if text.startswith(",", index):
            index += 1
            continue
        if not text.startswith("]", index):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, index)
        index += 1
        break
    if text[index:].strip(_WHITESPACE):
        raise json.JSONDecodeError("Extra data", text, index)
    return items
