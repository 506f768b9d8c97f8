"""Lossless tensor encodings: a full copy, or a delta against the same tensor of the parent version.

Deltas work on bit patterns in the engine dtype (bf16 weights are compared as uint16 words), so a decoded tensor
is the published one bit for bit. After a small optimizer step most bf16 words do not change at all, which is
what the encodings exploit:

- `zstd`             the raw bytes, zstd-compressed (snapshots; tensors that changed almost everywhere);
- `xor-zstd`         new XOR old, split into byte planes (all first bytes, then all second bytes, ...), zstd —
                     good when many words change by a few low bits;
- `sparse-xor-zstd`  only the changed words: a header (count, gap width), the index gaps between changed words
                     (uint32, uint64 beyond 4G elements) as byte planes, then their XOR values as byte planes, zstd —
                     good when few words change (the usual case: ~0.1% of bf16 words at lr 1e-6).

`encode_delta` tries the candidates that can win at the measured change density and keeps the smallest. Every
blob is one zstd frame with its content checksum; `decode` checks lengths, index bounds and that checksum and
raises StoreCorruptError on anything inconsistent. It does not check the result against the manifest's sha256:
the caller does (weights.py), so a delta applied to the wrong base is caught there. Words are read in the host's
byte order, which is little-endian on every platform the engines run on (x86-64, aarch64), as safetensors is.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from miles.weightsync.errors import StoreCorruptError

ENCODING_FULL = "zstd"
ENCODING_XOR = "xor-zstd"
ENCODING_SPARSE = "sparse-xor-zstd"
DELTA_ENCODINGS = frozenset({ENCODING_XOR, ENCODING_SPARSE})
ENCODINGS = frozenset({ENCODING_FULL, *DELTA_ENCODINGS})

_WORD_DTYPES: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SPARSE_HEADER = struct.Struct("<QB7x")  # number of changed words, gap width in bytes
_SPARSE_MAX_DENSITY = 0.3  # beyond this the sparse form cannot beat the plane-split XOR
_XOR_MIN_DENSITY = 0.005  # below this the sparse form always wins
_FULL_MIN_DENSITY = 0.3


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor's stored form: its encoding name, the blob bytes, and how many words changed."""

    encoding: str
    blob: bytes
    num_changed: int


def _words(data: bytes | bytearray | memoryview, itemsize: int) -> np.ndarray:
    if itemsize not in _WORD_DTYPES:
        raise ValueError(f"unsupported element size {itemsize}")
    return np.frombuffer(data, dtype=_WORD_DTYPES[itemsize])


def _planes(words: np.ndarray) -> bytes:
    """Byte planes of little-endian words: all byte 0s, then all byte 1s, ... (groups similar bytes for zstd)."""
    itemsize = words.dtype.itemsize
    if itemsize == 1:
        return words.tobytes()
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, itemsize).T).tobytes()


def _unplanes(data: bytes | memoryview, itemsize: int, count: int) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8, count=count * itemsize)
    if itemsize == 1:
        return raw.copy()
    return np.ascontiguousarray(raw.reshape(itemsize, count).T).view(_WORD_DTYPES[itemsize]).reshape(count)


def _compress(payload: bytes | bytearray | memoryview, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True).compress(payload)


def _decompress(blob: bytes, max_bytes: int) -> bytes:
    try:
        return bytes(zstandard.ZstdDecompressor().decompress(blob, max_output_size=max_bytes))
    except zstandard.ZstdError as exc:
        raise StoreCorruptError(f"blob does not decompress: {exc}") from exc


def encode_full(raw: bytes | bytearray | memoryview, *, level: int = 1) -> EncodedTensor:
    """A full copy (counts every element as changed)."""
    return EncodedTensor(ENCODING_FULL, _compress(raw, level), -1)


def _encode_sparse(xor: np.ndarray, changed: np.ndarray, level: int) -> bytes:
    gaps = np.diff(changed, prepend=-1)
    gap_dtype = np.uint32 if changed.size == 0 or int(gaps.max()) < (1 << 32) else np.uint64
    gap_words = gaps.astype(gap_dtype)
    header = _SPARSE_HEADER.pack(int(changed.size), gap_words.dtype.itemsize)
    return _compress(header + _planes(gap_words) + _planes(xor[changed]), level)


def encode_delta(
    base: bytes | bytearray | memoryview, new: bytes | bytearray | memoryview, itemsize: int, *, level: int = 1
) -> EncodedTensor:
    """The smallest lossless encoding of `new` given `base` (same byte length), among the forms that can win."""
    if len(base) != len(new):
        raise ValueError("base and new tensors differ in byte length")
    base_words, new_words = _words(base, itemsize), _words(new, itemsize)
    xor = np.bitwise_xor(base_words, new_words)
    changed = np.flatnonzero(xor)
    density = changed.size / max(1, xor.size)
    candidates: list[EncodedTensor] = []
    if density <= _SPARSE_MAX_DENSITY:
        candidates.append(EncodedTensor(ENCODING_SPARSE, _encode_sparse(xor, changed, level), int(changed.size)))
    if density >= _XOR_MIN_DENSITY:
        candidates.append(EncodedTensor(ENCODING_XOR, _compress(_planes(xor), level), int(changed.size)))
    if density >= _FULL_MIN_DENSITY:
        candidates.append(EncodedTensor(ENCODING_FULL, _compress(new, level), int(changed.size)))
    return min(candidates, key=lambda candidate: len(candidate.blob))


def decode(encoding: str, blob: bytes, *, num_bytes: int, itemsize: int, base: bytes | bytearray | None) -> bytes:
    """The tensor's raw bytes from its stored form; raises StoreCorruptError when the blob is inconsistent."""
    if encoding == ENCODING_FULL:
        raw = _decompress(blob, num_bytes)
        if len(raw) != num_bytes:
            raise StoreCorruptError(f"full blob decodes to {len(raw)} bytes, expected {num_bytes}")
        return raw
    if encoding not in DELTA_ENCODINGS:
        raise StoreCorruptError(f"unknown encoding {encoding!r}")
    if base is None or len(base) != num_bytes:
        raise StoreCorruptError("a delta needs the parent tensor of the same byte length")
    base_words = _words(base, itemsize)
    if encoding == ENCODING_XOR:
        payload = _decompress(blob, num_bytes)
        if len(payload) != num_bytes:
            raise StoreCorruptError(f"xor blob decodes to {len(payload)} bytes, expected {num_bytes}")
        merged: bytes = np.bitwise_xor(base_words, _unplanes(payload, itemsize, base_words.size)).tobytes()
        return merged
    return _decode_sparse(blob, base_words, itemsize)


def _decode_sparse(blob: bytes, base_words: np.ndarray, itemsize: int) -> bytes:
    num_elements = base_words.size
    payload = _decompress(blob, _SPARSE_HEADER.size + num_elements * (8 + itemsize))
    if len(payload) < _SPARSE_HEADER.size:
        raise StoreCorruptError("sparse blob shorter than its header")
    count, gap_width = _SPARSE_HEADER.unpack_from(payload)
    if gap_width not in (4, 8) or count > num_elements:
        raise StoreCorruptError("sparse blob header is inconsistent")
    body = memoryview(payload)[_SPARSE_HEADER.size :]
    if len(body) != count * (gap_width + itemsize):
        raise StoreCorruptError("sparse blob length does not match its header")
    gaps = _unplanes(body[: count * gap_width], gap_width, count).astype(np.int64)
    values = _unplanes(body[count * gap_width :], itemsize, count)
    if count and (int(gaps.min()) < 1):
        raise StoreCorruptError("sparse blob has a zero gap")
    positions = np.cumsum(gaps) - 1
    if count and int(positions[-1]) >= num_elements:
        raise StoreCorruptError("sparse blob points past the tensor")
    out = base_words.copy()
    out[positions] ^= values.astype(out.dtype, copy=False)
    return out.tobytes()
