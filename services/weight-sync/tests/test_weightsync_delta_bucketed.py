"""The bucketed delta encoding (bucketed-diff-zstd): exact round trips for every word size with the patterns at
the edges of the float formats and of its order-preserving view, dense and sparse buckets, tensors spanning
several scan segments; chosen (and smaller) for an optimizer-like step; inconsistent blobs refused."""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import pytest
import zstandard

from miles.weightsync.delta import ENCODING_BUCKETED, _encode_sparse, decode, encode_delta
from miles.weightsync.delta_bucketed import _ordered, encode_bucketed
from miles.weightsync.errors import StoreCorruptError

_UNSIGNED: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_EXPONENT_BITS = {1: (4,), 2: (5, 8), 4: (8,), 8: (11,)}  # fp8 e4m3; fp16, bf16; fp32; fp64
_HEADER, _BUCKET = struct.Struct("<QB7x"), struct.Struct("<HHBBBxQ")


def _round_trip(base: np.ndarray, new: np.ndarray) -> bytes:
    """The bucketed encoder itself (not the smallest candidate), so every case goes through it."""
    blob = encode_bucketed(base, new, np.flatnonzero(base != new), 1)
    decoded = decode(ENCODING_BUCKETED, blob, num_bytes=new.nbytes, itemsize=new.dtype.itemsize, base=base.tobytes())
    assert decoded == new.tobytes()
    return blob


def _special_words(itemsize: int) -> np.ndarray:
    """+-0, +-inf, NaNs (quiet, signalling, largest payload), largest finite, +-smallest and a large subnormal,
    and the patterns where the order-preserving view wraps (0x7fff / 0x8000 / 0xffff for 2-byte words)."""
    bits = 8 * itemsize
    top, ones = 1 << (bits - 1), (1 << bits) - 1
    words = {0, 1, 2, top, top | 1, top - 1, top + 1, ones, ones - 1}
    for exponent_bits in _EXPONENT_BITS[itemsize]:
        inf = ((1 << exponent_bits) - 1) << (bits - 1 - exponent_bits)
        quiet = 1 << (bits - 2 - exponent_bits)
        words |= {inf, inf | top, inf | quiet, inf | 1, inf - 1, (inf - 1) | top, quiet - 1, (quiet - 1) | top}
    return np.array(sorted(words), dtype=_UNSIGNED[itemsize])


def _bf16(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even (finite values)


def _adamw_like_bf16_step(num_words: int, lr: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """N(0, 0.02) float32 master weights published as bf16, before and after a first Adam step (lr * sign(g))."""
    rng = np.random.default_rng(seed)
    master = rng.normal(0.0, 0.02, num_words).astype(np.float32)
    return _bf16(master), _bf16(master - np.float32(lr) * np.sign(rng.standard_normal(num_words)).astype(np.float32))


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_special_patterns_round_trip_in_every_word_size(itemsize: int) -> None:
    rng = np.random.default_rng(itemsize)
    specials = _special_words(itemsize)
    base, new = rng.choice(specials, 4000), rng.choice(specials, 4000)  # sign flips, NaN <-> inf, 0x7fff -> 0x8000
    unchanged = rng.random(4000) < 0.5
    new[unchanged] = base[unchanged]
    _round_trip(base, new)
    one = _UNSIGNED[itemsize](1)
    _round_trip(specials, specials + one)  # +1 everywhere, wrapping at all-ones
    _round_trip(specials, specials - one)  # -1 everywhere, wrapping at zero


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_one_ulp_steps_round_trip_in_every_word_size(itemsize: int) -> None:
    rng = np.random.default_rng(itemsize)
    kind = _UNSIGNED[itemsize]
    base = rng.integers(0, 1 << (8 * itemsize - 2), 20_000, dtype=kind) | kind(1 << (8 * itemsize - 2))  # positive
    new = base + (rng.random(base.size) < 0.3).astype(kind)  # +1 ulp on 30%: small codes, no raw low bits
    _round_trip(base, new)
    _round_trip(new, base)


def test_bool_and_twos_complement_integer_tensors_round_trip() -> None:
    rng = np.random.default_rng(5)
    flags = rng.random(10_000) < 0.5
    _round_trip(flags.view(np.uint8), (flags ^ (rng.random(flags.size) < 0.01)).view(np.uint8))
    counts = rng.integers(-(2**40), 2**40, 10_000)  # int64, negatives in two's complement
    _round_trip(counts.view(np.uint64), (counts + rng.integers(-3, 4, counts.size)).view(np.uint64))
    steps = np.arange(-5_000, 5_000, dtype=np.int32)
    _round_trip(steps.view(np.uint32), (steps + 1).view(np.uint32))  # crosses -1 -> 0 (0xffffffff -> 0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numpy_float_steps_round_trip_with_subnormals_and_infinities(dtype: type[np.floating]) -> None:
    rng = np.random.default_rng(1)
    values = rng.normal(0.0, 0.02, 20_000).astype(dtype)
    values[:6] = [0.0, -0.0, np.inf, -np.inf, np.finfo(dtype).smallest_subnormal, -np.finfo(dtype).max]
    base = values.view(_UNSIGNED[values.itemsize])
    stepped = (values - dtype(1e-6) * np.sign(rng.standard_normal(values.size)).astype(dtype)).astype(dtype)
    _round_trip(base, stepped.view(base.dtype))


def test_every_word_changed_round_trips_and_is_stored_bucketed() -> None:
    base, _ = _adamw_like_bf16_step(50_000, lr=0.0)
    new = base + np.random.default_rng(2).integers(1, 4, base.size).astype(np.uint16)  # 1-3 ulp up everywhere
    encoded = encode_delta(base.tobytes(), new.tobytes(), 2)
    assert encoded.encoding == ENCODING_BUCKETED and encoded.num_changed == base.size
    assert (
        decode(ENCODING_BUCKETED, encoded.blob, num_bytes=new.nbytes, itemsize=2, base=base.tobytes()) == new.tobytes()
    )
    _round_trip(base, np.random.default_rng(3).integers(0, 2**16, base.size, dtype=np.uint16))  # unrelated words


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_empty_and_unchanged_tensors_round_trip(itemsize: int) -> None:
    empty = np.zeros(0, dtype=_UNSIGNED[itemsize])
    _round_trip(empty, empty)
    assert encode_delta(b"", b"", itemsize).num_changed == 0
    words = _special_words(itemsize)
    _round_trip(words, words)


def test_tensor_spanning_several_scan_segments_round_trips_with_dense_and_sparse_buckets() -> None:
    base, new = _adamw_like_bf16_step((1 << 20) + 4099, lr=3e-6, seed=4)  # segments are 2**20 words
    payload = zstandard.ZstdDecompressor().decompress(_round_trip(base, new))
    num_buckets = _HEADER.unpack_from(payload)[1]
    dense = [_BUCKET.unpack_from(payload, _HEADER.size + i * _BUCKET.size)[2] for i in range(num_buckets)]
    assert 0 in dense and 1 in dense  # small |w| change most of the time: coded densely


def test_adamw_like_bf16_step_is_stored_bucketed_and_well_below_sparse_xor() -> None:
    base, new = _adamw_like_bf16_step(300_000, lr=1e-6)
    encoded = encode_delta(base.tobytes(), new.tobytes(), 2)
    assert encoded.encoding == ENCODING_BUCKETED
    xor = base ^ new
    assert len(encoded.blob) < 0.75 * len(_encode_sparse(xor, np.flatnonzero(xor), 1))


def test_order_preserving_view_sorts_bf16_values_and_inverts() -> None:
    words = np.arange(1 << 16, dtype=np.uint16)
    values = (words.astype(np.uint32) << 16).view(np.float32)
    not_nan = np.flatnonzero(~np.isnan(values))
    by_view = not_nan[np.argsort(_ordered(words[not_nan]), kind="stable")]
    assert np.all(np.diff(values[by_view]) >= 0)  # -0.0 sorts next to +0.0
    assert np.array_equal(_ordered(_ordered(words), inverse=True), words)


def _rewrapped(blob: bytes, mutate: Callable[[bytearray], None]) -> bytes:
    """The blob's payload changed by `mutate`, in a frame with a valid checksum (only the decoder's checks help)."""
    payload = bytearray(zstandard.ZstdDecompressor().decompress(blob))
    mutate(payload)
    return zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(bytes(payload))


def _set(offset: int, fmt: str, value: int) -> Callable[[bytearray], None]:
    return lambda payload: struct.pack_into(fmt, payload, offset, value)


_BUCKET_0 = _HEADER.size  # lo, hi (H), dense, gap shift, change shift (B), count (Q)
_MUTATIONS = {
    "word count": _set(0, "<Q", 300_001),
    "no buckets": _set(8, "<B", 0),
    "bounds not tiling": _set(_BUCKET_0 + 2, "<H", 300),
    "dense flag": _set(_BUCKET_0 + 4, "<B", 2),
    "gap shift": _set(_BUCKET_0 + 5, "<B", 64),
    "count": _set(_BUCKET_0 + 8, "<Q", 1 << 40),
    "stream table": lambda payload: struct.pack_into("<Q", payload, _BUCKET_0 + payload[8] * _BUCKET.size, 1),
    "trailing byte": lambda payload: payload.append(0),
    "truncated stream": lambda payload: payload.__delitem__(slice(-1, None)),
}


@pytest.mark.parametrize("mutation", sorted(_MUTATIONS))
def test_inconsistent_bucketed_payload_is_refused(mutation: str) -> None:
    base, new = _adamw_like_bf16_step(300_000, lr=1e-6)
    blob = _rewrapped(_round_trip(base, new), _MUTATIONS[mutation])
    with pytest.raises(StoreCorruptError):
        decode(ENCODING_BUCKETED, blob, num_bytes=new.nbytes, itemsize=2, base=base.tobytes())


@pytest.mark.parametrize("position", [0.05, 0.5, 0.95])
def test_flipped_or_truncated_bucketed_blob_is_refused(position: float) -> None:
    base, new = _adamw_like_bf16_step(100_000, lr=1e-6)
    blob = bytearray(_round_trip(base, new))
    blob[int(len(blob) * position)] ^= 0x40
    for damaged in (bytes(blob), _round_trip(base, new)[: int(len(blob) * position)]):
        with pytest.raises(StoreCorruptError):
            decode(ENCODING_BUCKETED, damaged, num_bytes=new.nbytes, itemsize=2, base=base.tobytes())


def test_parent_with_fewer_bucket_members_than_coded_changes_is_refused() -> None:
    base, new = _adamw_like_bf16_step(100_000, lr=1e-6)
    blob = _round_trip(base, new)
    wrong_parent = np.zeros_like(base)  # every word in the lowest-magnitude bucket
    with pytest.raises(StoreCorruptError):
        decode(ENCODING_BUCKETED, blob, num_bytes=new.nbytes, itemsize=2, base=wrong_parent.tobytes())
