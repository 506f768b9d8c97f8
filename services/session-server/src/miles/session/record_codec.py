"""How a linear session's `TurnRecord` is stored in Redis: a small JSON header and the two arrays as raw bytes.

A long turn's record is dominated by its arrays (500k completion ids and as many 17-digit logprobs: ~14 MB of
JSON). Parsing that with `json.loads` holds the GIL for ~250 ms in one C call, in whatever thread it runs, and
every live turn of the replica waits behind it (a session GET or samples export reads all the records). Stored
as little-endian int32 ids and float64 logprobs, the same record decodes in ~15 ms of array copies, done in
slices (`records.unpack_array`) so that no single call holds the GIL for more than about a millisecond.

Layout: MAGIC, the header's length (uint32 LE), the header (UTF-8 JSON: the record's scalar fields, `num_tokens`
and `has_null_logprobs`), then num_tokens int32 ids and num_tokens float64 logprobs. A null logprob (the engine
sent none) is stored as NaN, which no real logprob can be (JSON answers refuse NaN). Records stored as JSON
before this format (they start with `{`) still decode.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import sys
from array import array
from dataclasses import fields
from typing import Any

from miles.session.records import TurnRecord, dumps, unpack_array

MAGIC = b"MTR1"
_HEADER_LENGTH = struct.Struct("<I")
_ARRAYS = ("completion_ids", "logprobs")


def encode_record(record: TurnRecord) -> bytes:
    """`record` in the stored layout (see the module docstring)."""
    header: dict[str, Any] = {f.name: getattr(record, f.name) for f in fields(record) if f.name not in _ARRAYS}
    header["finish_type"] = record.finish_type.value
    header["num_tokens"] = len(record.completion_ids)
    header["has_null_logprobs"] = any(lp is None for lp in record.logprobs)
    ids = array("i", record.completion_ids)
    logprobs = array("d", (math.nan if lp is None else lp for lp in record.logprobs))
    if sys.byteorder != "little":
        ids.byteswap()
        logprobs.byteswap()
    head = dumps(header).encode()
    return b"".join((MAGIC, _HEADER_LENGTH.pack(len(head)), head, ids.tobytes(), logprobs.tobytes()))


def decode_record(data: bytes | str) -> TurnRecord:
    """A stored record, in this layout or the JSON of before."""
    if isinstance(data, str) or not data.startswith(MAGIC):
        return TurnRecord.from_json(json.loads(data))
    (head_len,) = _HEADER_LENGTH.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _HEADER_LENGTH.size
    header = json.loads(data[start : start + head_len])
    num_tokens = int(header.pop("num_tokens"))
    has_nulls = bool(header.pop("has_null_logprobs"))
    ids_at = start + head_len
    logprobs_at = ids_at + 4 * num_tokens
    if len(data) != logprobs_at + 8 * num_tokens:
        raise ValueError(f"stored record of {len(data)} bytes does not hold {num_tokens} tokens")
    view = memoryview(data)
    logprobs: list[float | None] = unpack_array("d", view[logprobs_at:])
    if has_nulls:
        logprobs = [None if lp is not None and math.isnan(lp) else lp for lp in logprobs]  # NaN marks a null
    shell = TurnRecord.from_json({**header, "completion_ids": [], "logprobs": []})
    return dataclasses.replace(shell, completion_ids=unpack_array("i", view[ids_at:logprobs_at]), logprobs=logprobs)
