"""Lossless delta encodings: exact round trips in every element size, the encoding chosen by change density,
corruption detected instead of producing wrong bytes, and blobs of the earlier encodings still decoding.
The bucketed encoding's own cases are in test_weightsync_delta_bucketed.py."""

from __future__ import annotations

import numpy as np
import pytest

from miles.weightsync.delta import (
    ENCODING_BUCKETED,
    ENCODING_FULL,
    ENCODING_SPARSE,
    ENCODING_XOR,
    decode,
    encode_delta,
    encode_full,
)
from miles.weightsync.errors import StoreCorruptError


def _changed(base: bytes, itemsize: int, fraction: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    words = np.frombuffer(base, dtype=f"u{itemsize}").copy()
    positions = rng.choice(words.size, int(words.size * fraction), replace=False)
    words[positions] ^= rng.integers(1, 2**8, positions.size).astype(words.dtype)  # low bits, like a small step
    return words.tobytes()


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.05, 0.6, 1.0])
def test_delta_round_trips_bit_exact(itemsize: int, fraction: float) -> None:
    base = np.random.default_rng(itemsize).integers(0, 256, 4096 * itemsize, dtype=np.uint8).tobytes()
    new = _changed(base, itemsize, fraction, seed=7)
    encoded = encode_delta(base, new, itemsize)
    assert decode(encoded.encoding, encoded.blob, num_bytes=len(new), itemsize=itemsize, base=base) == new
    assert encoded.num_changed == int(4096 * fraction)


def test_sparse_changes_of_random_words_use_a_sparse_form_and_stay_small() -> None:
    base = np.random.default_rng(0).integers(0, 2**16, 1_000_000, dtype=np.uint16).tobytes()
    new = _changed(base, 2, 0.001, seed=1)
    encoded = encode_delta(base, new, 2)
    assert encoded.encoding in (ENCODING_SPARSE, ENCODING_BUCKETED)  # random words: neither has an edge
    assert len(encoded.blob) < 0.004 * len(new)  # ~1,000 changed words of 1,000,000


def test_dense_changes_use_xor_or_full() -> None:
    base = np.random.default_rng(0).integers(0, 2**16, 100_000, dtype=np.uint16).tobytes()
    assert encode_delta(base, _changed(base, 2, 0.6, seed=1), 2).encoding in (ENCODING_XOR, ENCODING_FULL)


def test_unchanged_tensor_costs_a_few_bytes() -> None:
    base = bytes(range(256)) * 1000
    encoded = encode_delta(base, base, 2)
    assert encoded.num_changed == 0 and len(encoded.blob) < 64


@pytest.mark.parametrize("position", [0.1, 0.5, 0.95])
def test_flipped_blob_byte_is_detected(position: float) -> None:
    base = np.random.default_rng(0).integers(0, 2**16, 50_000, dtype=np.uint16).tobytes()
    new = _changed(base, 2, 0.01, seed=3)
    encoded = encode_delta(base, new, 2)
    blob = bytearray(encoded.blob)
    blob[int(len(blob) * position)] ^= 0x40
    with pytest.raises(StoreCorruptError):
        decode(encoded.encoding, bytes(blob), num_bytes=len(new), itemsize=2, base=base)


def test_truncated_or_mismatched_blobs_are_refused() -> None:
    raw = bytes(range(200)) * 50
    full = encode_full(raw)
    with pytest.raises(StoreCorruptError):
        decode(full.encoding, full.blob[:-3], num_bytes=len(raw), itemsize=2, base=None)
    with pytest.raises(StoreCorruptError):
        decode(full.encoding, full.blob, num_bytes=len(raw) + 2, itemsize=2, base=None)
    delta = encode_delta(raw, raw[::-1], 2)
    with pytest.raises(StoreCorruptError):
        decode(delta.encoding, delta.blob, num_bytes=len(raw), itemsize=2, base=None)
    with pytest.raises(StoreCorruptError):
        decode("lz4", delta.blob, num_bytes=len(raw), itemsize=2, base=raw)


# Blobs written by the encoders before bucketed-diff-zstd existed (64 uint16 words, 3 changed / all changed).
_LEGACY_BASE = (np.arange(64, dtype=np.uint16) * 977 + 12345).astype(np.uint16)
_LEGACY_NEW = _LEGACY_BASE.copy()
_LEGACY_NEW[[3, 17, 40]] ^= np.array([1, 6, 0x80], dtype=np.uint16)
_LEGACY_BLOBS = [
    (ENCODING_SPARSE, "28b52ffd2422bd00007003000400040e1700010680000000031000840c3c6001c3e41cf0", _LEGACY_NEW),
    (ENCODING_XOR, "28b52ffd24809500004800000001000600800003100033e10f735a3185141f", _LEGACY_NEW),
    (ENCODING_XOR, "28b52ffd24805d000018030300020004929804b04d32785c", _LEGACY_BASE ^ np.uint16(3)),
]


@pytest.mark.parametrize(("encoding", "blob_hex", "expected"), _LEGACY_BLOBS)
def test_blobs_of_the_earlier_encodings_still_decode(encoding: str, blob_hex: str, expected: np.ndarray) -> None:
    raw = decode(encoding, bytes.fromhex(blob_hex), num_bytes=128, itemsize=2, base=_LEGACY_BASE.tobytes())
    assert raw == expected.tobytes()
