"""Protobuf wire-format helpers that let stored group bytes pass through the gRPC layer untouched.

A group is stored as the serialized `miles.common.v1.Group` it arrived as and leaves as those same bytes, spliced
into the response as a length-delimited field. This is plain protobuf semantics (fields may come in any order,
a repeated occurrence of an embedded message merges, a later occurrence of a scalar field wins), and it saves a
parse and a serialize of every group (about a millisecond each for 8 samples x 4K tokens in Python).
Only the top level of already-parsed messages is scanned here; groups are never decoded by hand.
"""

from __future__ import annotations

_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def len_field(field_number: int, payload: bytes) -> bytes:
    """One length-delimited field (embedded message, bytes or string) on the wire."""
    return _varint(field_number << 3 | _WIRE_LEN) + _varint(len(payload)) + payload


def top_level_len_field(message_bytes: bytes, field_number: int) -> bytes:
    """The payload of a length-delimited field at the top level of a serialized message; several occurrences
    are concatenated (which is their merge, for an embedded message). `message_bytes` must already have parsed
    as a valid message; ValueError on a wire type this scanner does not skip (deprecated groups)."""
    parts: list[bytes] = []
    pos = 0
    while pos < len(message_bytes):
        tag, pos = _read_varint(message_bytes, pos)
        wire_type = tag & 7
        if wire_type == _WIRE_VARINT:
            _, pos = _read_varint(message_bytes, pos)
        elif wire_type == _WIRE_I64:
            pos += 8
        elif wire_type == _WIRE_I32:
            pos += 4
        elif wire_type == _WIRE_LEN:
            length, pos = _read_varint(message_bytes, pos)
            if tag >> 3 == field_number:
                parts.append(message_bytes[pos : pos + length])
            pos += length
        else:
            raise ValueError(f"unsupported wire type {wire_type} at byte {pos}")
    return b"".join(parts)
