"""Lossless tensor encodings: a full copy, or a delta against the same tensor of the parent version.

Deltas work on bit patterns in the engine dtype (bf16 weights are compared as uint16 words), so a decoded tensor
is the published one bit for bit. After a small optimizer step most words do not change, and those that do move
by an ulp or a few, which is what the encodings exploit:

- `zstd`                the raw bytes, zstd-compressed (snapshots; tensors that changed almost everywhere);
- `xor-zstd`            new XOR old, split into byte planes (words flipping low bits with no float structure);
- `sparse-xor-zstd`     the index gaps between changed words and their XOR values, as byte planes (the default
                        before bucketed-diff-zstd; still smallest for random words and some tiny tensors);
- `bucketed-diff-zstd`  the parent's words in up to 2 buckets by magnitude (the 8 bits after the sign: the exponent
                        of bf16 and fp32), which the decoder recomputes from the parent. A small |w| has a finer ulp,
                        so the same update changes it more often; coding each bucket apart costs about
                        H(change | exponent), well below H(change). Per bucket: the gaps between its changed words
                        (counted in the bucket) and their changes, or, where most of it changes, every word's
                        change. A change is new - old in an order-preserving integer view of the float
                        (sign-magnitude -> monotonic, wrapping), zigzag-coded: after a small step mostly +-1 ulp,
                        ~1 bit where the XOR of the same change has ~2.8 (carries). Integers are split into byte
                        streams (_pack_ints), each its own inner zstd frame so that each gets its own Huffman table.

`encode_delta` tries the candidates that can win at the measured change density and keeps the smallest. Every
blob is one zstd frame with its content checksum; `decode` checks lengths, index bounds, every inner stream's size
and that checksum and raises StoreCorruptError on anything inconsistent. It does not check the result against
the manifest's sha256: the caller does (weights.py), so a delta applied to the wrong base is caught there. Words
are read in the host's byte order, which is little-endian on every platform the engines run on (x86-64, aarch64),
as safetensors is.

Limits: the buckets assume sign-magnitude floats (integer tensors round-trip exactly but gain nothing from them).
Decoding a bucketed delta scans the parent's exponents and maps ranks back to words: ~2x the time of the XOR forms
(which are two copies of the tensor), all vectorised numpy on one core. A densely coded bucket holds a word-sized
change per word while encoding and decoding (a few times the tensor's bytes at peak).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from miles.weightsync.delta_bucketed import decode_bucketed, encode_bucketed
from miles.weightsync.delta_words import compress, decompress, planes, unplanes, words
from miles.weightsync.errors import StoreCorruptError

ENCODING_FULL = "zstd"
ENCODING_XOR = "xor-zstd"
ENCODING_SPARSE = "sparse-xor-zstd"
ENCODING_BUCKETED = "bucketed-diff-zstd"
DELTA_ENCODINGS = frozenset({ENCODING_XOR, ENCODING_SPARSE, ENCODING_BUCKETED})
ENCODINGS = frozenset({ENCODING_FULL, *DELTA_ENCODINGS})

_SPARSE_HEADER = struct.Struct("<QB7x")  # number of changed words, gap width in bytes
_DENSE_DELTA = 0.3  # share of changed words from which XOR planes and full copies, not sparse XOR, can win


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor's stored form: its encoding name, the blob bytes, and how many words changed."""

    encoding: str
    blob: bytes
    num_changed: int


def encode_full(raw: bytes | bytearray | memoryview, *, level: int = 1) -> EncodedTensor:
    """A full copy (counts every element as changed)."""
    return EncodedTensor(ENCODING_FULL, compress(raw, level), -1)


def _encode_sparse(xor: np.ndarray, changed: np.ndarray, level: int) -> bytes:
    gaps = np.diff(changed, prepend=-1)
    gap_dtype = np.uint32 if changed.size == 0 or int(gaps.max()) < (1 << 32) else np.uint64
    gap_words = gaps.astype(gap_dtype)
    header = _SPARSE_HEADER.pack(int(changed.size), gap_words.dtype.itemsize)
    return compress(header + planes(gap_words) + planes(xor[changed]), level)


def encode_delta(
    base: bytes | bytearray | memoryview, new: bytes | bytearray | memoryview, itemsize: int, *, level: int = 1
) -> EncodedTensor:
    """The smallest lossless encoding of `new` given `base` (same byte length), among the forms that can win."""
    if len(base) != len(new):
        raise ValueError("base and new tensors differ in byte length")
    base_words, new_words = words(base, itemsize), words(new, itemsize)
    xor = np.bitwise_xor(base_words, new_words)
    changed = np.flatnonzero(xor != 0)
    num_changed = int(changed.size)
    density = num_changed / max(1, xor.size)
    candidates = [EncodedTensor(ENCODING_BUCKETED, encode_bucketed(base_words, new_words, changed, level), 0)]
    if density <= _DENSE_DELTA:
        candidates.append(EncodedTensor(ENCODING_SPARSE, _encode_sparse(xor, changed, level), 0))
    else:
        candidates.append(EncodedTensor(ENCODING_XOR, compress(planes(xor), level), 0))
        candidates.append(EncodedTensor(ENCODING_FULL, compress(new, level), 0))
    best = min(candidates, key=lambda candidate: len(candidate.blob))
    return EncodedTensor(best.encoding, best.blob, num_changed)


def decode(encoding: str, blob: bytes, *, num_bytes: int, itemsize: int, base: bytes | bytearray | None) -> bytes:
    """The tensor's raw bytes from its stored form; raises StoreCorruptError when the blob is inconsistent."""
    if encoding == ENCODING_FULL:
        raw = decompress(blob, num_bytes)
        if len(raw) != num_bytes:
            raise StoreCorruptError(f"full blob decodes to {len(raw)} bytes, expected {num_bytes}")
        return raw
    if encoding not in DELTA_ENCODINGS:
        raise StoreCorruptError(f"unknown encoding {encoding!r}")
    if base is None or len(base) != num_bytes:
        raise StoreCorruptError("a delta needs the parent tensor of the same byte length")
    base_words = words(base, itemsize)
    if encoding == ENCODING_XOR:
        payload = decompress(blob, num_bytes)
        if len(payload) != num_bytes:
            raise StoreCorruptError(f"xor blob decodes to {len(payload)} bytes, expected {num_bytes}")
        merged: bytes = np.bitwise_xor(base_words, unplanes(payload, itemsize, base_words.size)).tobytes()
        return merged
    if encoding == ENCODING_BUCKETED:
        return decode_bucketed(blob, base_words)
    return _decode_sparse(blob, base_words, itemsize)


def _decode_sparse(blob: bytes, base_words: np.ndarray, itemsize: int) -> bytes:
    num_elements = base_words.size
    payload = decompress(blob, _SPARSE_HEADER.size + num_elements * (8 + itemsize))
    if len(payload) < _SPARSE_HEADER.size:
        raise StoreCorruptError("sparse blob shorter than its header")
    count, gap_width = _SPARSE_HEADER.unpack_from(payload)
    if gap_width not in (4, 8) or count > num_elements:
        raise StoreCorruptError("sparse blob header is inconsistent")
    body = memoryview(payload)[_SPARSE_HEADER.size :]
    if len(body) != count * (gap_width + itemsize):
        raise StoreCorruptError("sparse blob length does not match its header")
    gaps = unplanes(body[: count * gap_width], gap_width, count).astype(np.int64)
    values = unplanes(body[count * gap_width :], itemsize, count)
    if count and (int(gaps.min()) < 1):
        raise StoreCorruptError("sparse blob has a zero gap")
    positions = np.cumsum(gaps) - 1
    if count and int(positions[-1]) >= num_elements:
        raise StoreCorruptError("sparse blob points past the tensor")
    out = base_words.copy()
    out[positions] ^= values.astype(out.dtype, copy=False)
    return out.tobytes()
