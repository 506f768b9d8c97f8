"""A large answer written in pieces is the same JSON as one written at once, and no piece is large."""

from __future__ import annotations

import json
from typing import Any

import pytest

from miles.session.json_stream import (
    PIECE_BYTES,
    SLICE_ITEMS,
    STRING_SLICE_CHARS,
    encode_pieces,
    json_body,
    loads_array_in_pieces,
)

VIEW: dict[str, Any] = {
    "session_id": "s1",
    "messages": [{"role": "user", "content": 'héllo 🎉 "quoted"\n' * 50}, {"role": "assistant", "content": ""}],
    "accumulated_token_ids": list(range(3 * SLICE_ITEMS + 5)),
    "records": [{"completion_ids": [7] * (SLICE_ITEMS + 1), "logprobs": [-0.5, None] * 10, "finish": "stop"}],
    "tools": [],
    "empty": {},
    "tito_session_mismatch": None,
    "nested": [[1, 2], [], [{"a": [True, False, 1.25]}]],
}


async def test_the_pieces_add_up_to_the_json_of_the_whole_value() -> None:
    chunks = [chunk async for chunk in json_body(VIEW)]
    assert json.loads(b"".join(chunks)) == VIEW
    assert len(chunks) > 1 and all(len(chunk) < 4 * PIECE_BYTES for chunk in chunks)
    assert max(len(piece) for piece in encode_pieces(VIEW)) < 8 * SLICE_ITEMS


def test_nan_is_refused_as_starlette_does() -> None:
    with pytest.raises(ValueError, match="JSON compliant"):
        "".join(encode_pieces({"logprobs": [float("nan")]}))


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        " [ ] ",
        json.dumps(VIEW["messages"], ensure_ascii=False, separators=(",", ":")),
        json.dumps(VIEW["messages"], indent=2),
        '[1, "two", null, [3, {"four": 4}], {}]',
        "[[]]",
    ],
)
def test_an_array_parsed_element_by_element_equals_json_loads(text: str) -> None:
    assert loads_array_in_pieces(text) == json.loads(text)
    assert loads_array_in_pieces(text.encode()) == json.loads(text)


@pytest.mark.parametrize("text", ["[1,]", "[1 2]", "[1", "[", "[1] x", "[,1]", "{]"])
def test_a_malformed_array_is_refused_as_json_loads_refuses_it(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        loads_array_in_pieces(text)


def test_a_long_string_is_written_in_slices_with_the_same_escapes() -> None:
    text = ('héllo 🎉 "quoted"\n\\ \t\x01 \ud800 ' * 4000)[: 3 * STRING_SLICE_CHARS + 7]
    pieces = list(encode_pieces({"content": text}))
    assert "".join(pieces) == json.dumps({"content": text}, ensure_ascii=False, separators=(",", ":"))
    assert len(pieces) > 3 and max(len(piece) for piece in pieces) < 8 * STRING_SLICE_CHARS
