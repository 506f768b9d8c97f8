"""The `bucketed-diff-zstd` delta encoding (see delta.py for what it is and when it wins).

`encode_bucketed(base_words, new_words, changed, level)` returns the blob; `decode_bucketed(blob, base_words)`
returns the new tensor's bytes and raises StoreCorruptError on anything inconsistent (counts, bounds, stream
sizes, the outer frame's checksum). Both are vectorised numpy on one core.
"""

from __future__ import annotations

import struct
from itertools import pairwise

import numpy as np
import zstandard

from miles.weightsync.delta_words import compress, decompress, planes, unplanes
from miles.weightsync.errors import StoreCorruptError

_BUCKETED_HEADER = struct.Struct("<QB7x")  # number of words, number of buckets
_BUCKET = struct.Struct("<HHBBBxQ")  # magnitude keys [lo, hi), dense, gap shift, change shift, number coded
_STREAMS_PER_BUCKET = 8  # gaps, then changes: 4 streams each (see _pack_ints)
_MAX_BUCKETS = 2  # each costs the decoder a pass over the parent's keys (3: 7% smaller, 7-30% slower to decode)
_BUCKET_COST_BITS = 8 * 200.0  # header, stream table and frames of one more bucket
_DENSE_MIN_RATE = 0.35  # a bucket changing this often stores every word's change instead of gaps
_SEGMENT_WORDS = 1 << 20  # words per pass of the bucket scan (keeps its index arrays small and cached)
_LIST_MEMBERS_RATE = 64  # above 1 change in this many words, list a bucket's members instead of counting bits
_SHIFT_SAMPLE = 1 << 16  # values that choose a stream's low-bit count
_QUAD_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
_QUADS = ((np.arange(256, dtype=np.uint8)[:, None] >> _QUAD_SHIFTS) & 3).view(np.uint32).reshape(256)  # 4 symbols
_BYTE_BITS = np.cumsum(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"), axis=1)
_SELECT_IN_BYTE = np.argmax(_BYTE_BITS[:, None, :] == np.arange(1, 9)[None, :, None], axis=2)  # [byte, k]: k-th 1
_BYTES_ONES, _BYTES_HIGH = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)


def _ordered(words: np.ndarray, *, inverse: bool = False) -> np.ndarray:
    """Sign-magnitude bits <-> unsigned integers in numeric order (-0.0, +0.0 adjacent; NaNs at both ends)."""
    kind = words.dtype.type
    top = words.dtype.itemsize * 8 - 1
    negative = words >> kind(top)
    if inverse:
        negative ^= kind(1)
    flipped: np.ndarray = words ^ (negative * kind((1 << top) - 1) | kind(1 << top))
    return flipped


def _changes(base: np.ndarray, new: np.ndarray) -> np.ndarray:
    """new - old in the ordered view (wrapping), zigzag-coded: 0 unchanged, 1 = -1 ulp, 2 = +1 ulp, 3 = -2 ..."""
    kind = base.dtype.type
    diff = _ordered(new) - _ordered(base)
    sign = (diff >> kind(base.dtype.itemsize * 8 - 1)) * kind(np.iinfo(base.dtype).max)
    codes: np.ndarray = (diff << kind(1)) ^ sign
    return codes


def _applied(base: np.ndarray, codes: np.ndarray) -> np.ndarray:
    kind = base.dtype.type
    diff = (codes >> kind(1)) ^ ((codes & kind(1)) * kind(np.iinfo(base.dtype).max))
    return _ordered(_ordered(base) + diff, inverse=True)


def _magnitude_keys(words: np.ndarray) -> np.ndarray:
    """The 8 bits after the sign: the exponent of bf16 and fp32 (fp16: 5 exponent + 3 mantissa bits)."""
    if words.dtype.itemsize == 1:
        return words << np.uint8(1)
    keys: np.ndarray = (words >> words.dtype.type(words.dtype.itemsize * 8 - 9)).astype(np.uint8)
    return keys


def _partition(base_words: np.ndarray, changed: np.ndarray) -> tuple[list[int], list[bool]]:
    """Bucket bounds [0, ..., 256] over the magnitude keys (at most _MAX_BUCKETS) that minimise the entropy of the
    change positions given the bucket, and which buckets are dense; words per key are estimated from a sample."""
    sample = _magnitude_keys(base_words[:: max(1, base_words.size >> 16)])
    changes = np.bincount(_magnitude_keys(base_words[changed]), minlength=256).astype(np.float64)
    words = np.maximum(np.bincount(sample, minlength=256) * (base_words.size / max(1, sample.size)), changes)
    present = np.flatnonzero(words)
    cuts: list[int] = []
    if present.size > 1:
        sum_words = np.concatenate([[0.0], np.cumsum(words[present])])
        sum_changes = np.concatenate([[0.0], np.cumsum(changes[present])])
        span_words = sum_words[None, :] - sum_words[:, None]  # [i, j]: the words with keys present[i:j]
        span_changes = sum_changes[None, :] - sum_changes[:, None]
        rate = np.divide(span_changes, span_words, out=np.zeros_like(span_words), where=span_words > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            entropy_bits = -(rate * np.log2(rate) + (1 - rate) * np.log2(1 - rate))
        cost = span_words * np.nan_to_num(entropy_bits) + _BUCKET_COST_BITS
        cost[np.tril_indices(present.size + 1)] = np.inf  # a bucket is a non-empty range i < j
        layers, starts = [cost[0]], []
        for _ in range(1, _MAX_BUCKETS):
            total = layers[-1][:, None] + cost
            starts.append(np.argmin(total, axis=0))
            layers.append(np.min(total, axis=0))
        end = present.size
        for start in reversed(starts[: int(np.argmin([layer[-1] for layer in layers]))]):
            end = int(start[end])
            cuts.insert(0, int(present[end]))
    bounds = [0, *cuts, 256]
    dense = [changes[lo:hi].sum() >= max(1.0, _DENSE_MIN_RATE * words[lo:hi].sum()) for lo, hi in pairwise(bounds)]
    return bounds, [bool(flag) for flag in dense]


def _packed(mask: np.ndarray) -> np.ndarray:
    blocks = np.zeros(-(-mask.size // 64), dtype=np.uint64)
    packed = np.packbits(mask, bitorder="little")
    blocks.view(np.uint8)[: packed.size] = packed
    return blocks


def _segment_buckets(keys: np.ndarray, bounds: list[int]) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Per bucket, its members among `keys` as 64-bit blocks (bit i of block j: word 64 j + i), how many come
    before each block, and how many there are: one comparison per bound, no index lists."""
    everything = _packed(np.ones(keys.size, dtype=bool))
    edges = [np.zeros_like(everything), *(_packed(keys < cut) for cut in bounds[1:-1]), everything]
    buckets = []
    for lower, upper in pairwise(edges):
        blocks = upper & ~lower
        counts = np.bitwise_count(blocks).astype(np.int64)
        before = np.cumsum(counts) - counts
        buckets.append((blocks, before, int(counts.sum())))
    return buckets


def _members(blocks: np.ndarray, num_words: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(blocks.view(np.uint8), count=num_words, bitorder="little").view(bool))


def _ranks_of(blocks: np.ndarray, before: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """How many members precede each of `indices` (members themselves)."""
    block = indices >> 6
    below = (np.uint64(1) << (indices & 63).astype(np.uint64)) - np.uint64(1)
    ranks: np.ndarray = before[block] + np.bitwise_count(blocks[block] & below)
    return ranks


def _select(blocks: np.ndarray, before: np.ndarray, ranks: np.ndarray, num_words: int) -> np.ndarray:
    """The indices of the members with the given sorted ranks (each below the number of members): _ranks_of
    inverted, by broadword select (Vigna) in the block holding each rank, or by listing the members if many."""
    if ranks.size * _LIST_MEMBERS_RATE > num_words:
        listed: np.ndarray = _members(blocks, num_words)[ranks]
        return listed
    block = np.searchsorted(before, ranks, side="right") - 1
    word, within = blocks[block], (ranks - before[block]).astype(np.uint64)
    pairs = word - ((word >> np.uint64(1)) & np.uint64(0x5555555555555555))
    nibbles = (pairs & np.uint64(0x3333333333333333)) + ((pairs >> np.uint64(2)) & np.uint64(0x3333333333333333))
    prefix = ((nibbles + (nibbles >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)) * _BYTES_ONES  # per byte k:
    at_or_below = ((within * _BYTES_ONES) | _BYTES_HIGH) - prefix  # members in bytes 0..k; high bit: <= within
    byte_shift = np.bitwise_count(at_or_below & _BYTES_HIGH).astype(np.uint64) * np.uint64(8)
    rank_in_byte = within - (((prefix << np.uint64(8)) >> byte_shift) & np.uint64(0xFF))
    bit = _SELECT_IN_BYTE[((word >> byte_shift) & np.uint64(0xFF)).astype(np.intp), rank_in_byte.astype(np.intp)]
    indices: np.ndarray = block * 64 + byte_shift.astype(np.int64) + bit
    return indices


def _low_bits(values: np.ndarray) -> int:
    """How many low bits to store as raw byte planes: none for small values (a change's sign and size correlate),
    else all but 2 of the typical width, which leaves near-uniform low bits (gaps between rare changes)."""
    sample = values[:_SHIFT_SAMPLE]
    if sample.size == 0:
        return 0
    typical = int(np.partition(sample, sample.size * 9 // 10)[sample.size * 9 // 10]).bit_length()
    return typical - 2 if typical >= 6 else 0


def _pack_ints(values: np.ndarray, shift: int) -> list[bytes]:
    """Non-negative integers (unsigned, any width) as 4 byte streams that zstd's Huffman stage codes near their
    entropy: the high part (value >> shift) as 2-bit symbols packed 4 to a byte (3: see the next stream), high - 3
    as bytes (255: see the next stream), high - 3 >= 255 as byte planes of the values' width, and the low `shift`
    bits as byte planes. Four symbols to a byte let mostly +-1 ulp cost ~1 bit a change, not Huffman's 1.5+."""
    kind = values.dtype.type
    high = values >> kind(shift)
    symbols = np.zeros(-(-values.size // 4) * 4, dtype=np.uint8)
    symbols[: values.size] = np.minimum(high, 3)
    packed = np.bitwise_or.reduce(symbols.reshape(-1, 4) << _QUAD_SHIFTS, axis=1)
    rest = high[np.flatnonzero(high >= 3)] - kind(3)
    escapes = planes(rest[np.flatnonzero(rest >= 255)])
    low = planes(values & kind((1 << shift) - 1), -(-shift // 8))
    return [packed.tobytes(), np.minimum(rest, 255).astype(np.uint8).tobytes(), escapes, low]


def encode_bucketed(base_words: np.ndarray, new_words: np.ndarray, changed: np.ndarray, level: int) -> bytes:
    bounds, dense = _partition(base_words, changed)
    rank_parts: list[list[np.ndarray]] = [[np.zeros(0, np.int64)] for _ in dense]
    code_parts: list[list[np.ndarray]] = [[np.zeros(0, base_words.dtype)] for _ in dense]
    seen = [0] * len(dense)
    for start in range(0, base_words.size, _SEGMENT_WORDS):
        base_segment = base_words[start : start + _SEGMENT_WORDS]
        new_segment = new_words[start : start + _SEGMENT_WORDS]
        keys = _magnitude_keys(base_segment)
        changed_here = np.flatnonzero(base_segment != new_segment)
        bucket_of_changed = np.searchsorted(bounds[1:-1], keys[changed_here], side="right")
        for index, (blocks, before, num_members) in enumerate(_segment_buckets(keys, bounds)):
            if dense[index]:
                coded = _members(blocks, keys.size)
            else:
                coded = changed_here[np.flatnonzero(bucket_of_changed == index)]
                rank_parts[index].append(_ranks_of(blocks, before, coded) + seen[index])
            code_parts[index].append(_changes(base_segment[coded], new_segment[coded]))
            seen[index] += num_members
    header, streams = [_BUCKETED_HEADER.pack(base_words.size, len(dense))], []
    for (lo, hi), is_dense, rank_part, code_part in zip(pairwise(bounds), dense, rank_parts, code_parts, strict=True):
        gaps = (np.diff(np.concatenate(rank_part), prepend=-1) - 1).astype(np.uint64)
        codes = np.concatenate(code_part)
        gap_shift, code_shift = (0 if is_dense else _low_bits(gaps)), _low_bits(codes)
        header.append(_BUCKET.pack(lo, hi, is_dense, gap_shift, code_shift, codes.size))
        streams += [b""] * 4 if is_dense else _pack_ints(gaps, gap_shift)
        streams += _pack_ints(codes, code_shift)
    frames = [compress(stream, level, checksum=False) if stream else b"" for stream in streams]
    sizes = np.array([len(frame) for frame in frames], dtype="<u8").tobytes()
    return compress(b"".join([*header, sizes, *frames]), level)


class _InnerFrames:
    """The bucketed payload's inner zstd frames, read in order; each must hold exactly the bytes expected."""

    def __init__(self, payload: bytes, offset: int, sizes: list[int]) -> None:
        self._payload, self._offset, self._sizes = payload, offset, iter(sizes)

    def read(self, num_bytes: int) -> bytes:
        stored = next(self._sizes, -1)
        frame = self._payload[self._offset : self._offset + stored]
        self._offset += stored
        if stored < 0 or len(frame) != stored or (stored == 0) != (num_bytes == 0):
            raise StoreCorruptError("bucketed blob's stream table does not match its streams")
        if num_bytes == 0:
            return b""
        try:
            if zstandard.frame_content_size(frame) != num_bytes:
                raise StoreCorruptError(f"bucketed blob has a stream of the wrong size (expected {num_bytes})")
            return bytes(zstandard.ZstdDecompressor().decompress(frame, allow_extra_data=False))
        except zstandard.ZstdError as exc:
            raise StoreCorruptError(f"bucketed blob has a stream that does not decompress: {exc}") from exc

    def finished(self) -> bool:
        return self._offset == len(self._payload) and next(self._sizes, None) is None


def _unpack_ints(frames: _InnerFrames, count: int, shift: int, kind: type[np.unsignedinteger]) -> np.ndarray:
    """`count` integers of type `kind` packed by _pack_ints; raises StoreCorruptError if any would not fit."""
    width = np.dtype(kind).itemsize
    symbols = np.take(_QUADS, np.frombuffer(frames.read(-(-count // 4)), dtype=np.uint8)).view(np.uint8)[:count]
    big = np.flatnonzero(symbols == 3)
    rest_bytes = np.frombuffer(frames.read(big.size), dtype=np.uint8)
    huge = np.flatnonzero(rest_bytes == 255)
    escapes = unplanes(frames.read(width * huge.size), width, huge.size)
    if huge.size and not 255 <= int(escapes.min()) <= int(escapes.max()) <= (1 << (8 * width - shift)) - 4:
        raise StoreCorruptError("bucketed blob has an escaped integer out of range")
    high = symbols.astype(kind)
    rest = rest_bytes.astype(kind) + kind(3)
    rest[huge] = escapes + kind(3)
    high[big] = rest
    num_low = -(-shift // 8)
    low_planes = frames.read(count * num_low)
    if shift == 0:
        return high
    if count and int(high.max()) >> (8 * width - shift):
        raise StoreCorruptError("bucketed blob has an integer out of range")
    unpacked: np.ndarray = (high << kind(shift)) | unplanes(low_planes, width, count, num_low)
    return unpacked


def decode_bucketed(blob: bytes, base_words: np.ndarray) -> bytes:
    num_words, bits = base_words.size, 8 * base_words.dtype.itemsize
    stream_bound = _BUCKETED_HEADER.size + 256 * (_BUCKET.size + 8 * _STREAMS_PER_BUCKET) + 64 * num_words
    payload = decompress(blob, stream_bound)
    if len(payload) < _BUCKETED_HEADER.size:
        raise StoreCorruptError("bucketed blob shorter than its header")
    declared_words, num_buckets = _BUCKETED_HEADER.unpack_from(payload)
    sizes_at = _BUCKETED_HEADER.size + num_buckets * _BUCKET.size
    if declared_words != num_words or num_buckets < 1 or len(payload) < sizes_at + 64 * num_buckets:
        raise StoreCorruptError("bucketed blob header is inconsistent")
    sizes = np.frombuffer(payload, dtype="<u8", count=num_buckets * _STREAMS_PER_BUCKET, offset=sizes_at)
    frames = _InnerFrames(payload, sizes_at + sizes.nbytes, [int(size) for size in sizes])
    bounds, decoded = [0], []
    for index in range(num_buckets):
        lo, hi, dense, gap_shift, code_shift, count = _BUCKET.unpack_from(
            payload, _BUCKETED_HEADER.size + index * _BUCKET.size
        )
        if (
            lo != bounds[-1]
            or not lo < hi <= 256
            or dense > 1
            or gap_shift >= 64
            or code_shift >= bits
            or count > num_words
        ):
            raise StoreCorruptError("bucketed blob has an inconsistent bucket")
        bounds.append(hi)
        gaps = np.zeros(0, np.uint64) if dense else _unpack_ints(frames, count, gap_shift, np.uint64)
        if gaps.size and int(gaps.max()) >= num_words:
            raise StoreCorruptError("bucketed blob points past the tensor")
        ranks = None if dense else np.cumsum(gaps.astype(np.int64) + 1) - 1
        _ = [frames.read(0) for _ in range(4 if dense else 0)]
        codes = _unpack_ints(frames, count, code_shift, base_words.dtype.type)
        decoded.append((ranks, codes))
    if bounds[-1] != 256 or not frames.finished():
        raise StoreCorruptError("bucketed blob's buckets or streams are inconsistent")
    return _apply_buckets(base_words, bounds, decoded)


def _apply_buckets(
    base_words: np.ndarray, bounds: list[int], decoded: list[tuple[np.ndarray | None, np.ndarray]]
) -> bytes:
    """The new words: each bucket's (ranks, codes) applied segment by segment, its coded words found again from
    the parent's magnitude keys (ranks None: every member of the bucket is coded)."""
    out = base_words.copy()
    seen, used = [0] * len(decoded), [0] * len(decoded)
    for start in range(0, base_words.size, _SEGMENT_WORDS):
        base_segment, out_segment = base_words[start : start + _SEGMENT_WORDS], out[start : start + _SEGMENT_WORDS]
        keys = _magnitude_keys(base_segment)
        for index, (blocks, before, num_members) in enumerate(_segment_buckets(keys, bounds)):
            ranks, codes = decoded[index]
            if ranks is None:
                end = used[index] + num_members
                coded = _members(blocks, keys.size)
            else:
                end = int(np.searchsorted(ranks, seen[index] + num_members))
                coded = _select(blocks, before, ranks[used[index] : end] - seen[index], keys.size)
            if end > codes.size:
                raise StoreCorruptError("bucketed blob codes fewer words than its bucket holds")
            if end > used[index]:
                out_segment[coded] = _applied(base_segment[coded], codes[used[index] : end])
            used[index], seen[index] = end, seen[index] + num_members
    if any(end != codes.size for end, (_, codes) in zip(used, decoded, strict=True)):
        raise StoreCorruptError("bucketed blob codes more changes than its bucket holds")
    return out.tobytes()
