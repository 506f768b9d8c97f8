"""Word-level primitives of the delta encodings (delta.py, delta_bucketed.py): raw bytes as unsigned words, byte
planes, and zstd frames with a checksum whose decompression maps every zstd error to StoreCorruptError."""

from __future__ import annotations

import numpy as np
import zstandard

from miles.weightsync.errors import StoreCorruptError

WORD_DTYPES: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def words(data: bytes | bytearray | memoryview, itemsize: int) -> np.ndarray:
    if itemsize not in WORD_DTYPES:
        raise ValueError(f"unsupported element size {itemsize}")
    return np.frombuffer(data, dtype=WORD_DTYPES[itemsize])


def planes(words: np.ndarray, num_planes: int | None = None) -> bytes:
    """Byte planes of little-endian words: all byte 0s, then all byte 1s, ... (groups similar bytes for zstd);
    only the low `num_planes` planes when given."""
    itemsize = words.dtype.itemsize
    planes = itemsize if num_planes is None else num_planes
    if planes == 0 or itemsize == 1:
        return words.tobytes() if planes else b""
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, itemsize)[:, :planes].T).tobytes()


def unplanes(data: bytes | memoryview, itemsize: int, count: int, num_planes: int | None = None) -> np.ndarray:
    planes = itemsize if num_planes is None else num_planes
    raw = np.frombuffer(data, dtype=np.uint8, count=count * planes)
    if itemsize == 1:
        return raw.copy() if planes else np.zeros(count, dtype=np.uint8)
    words = np.zeros((count, itemsize), dtype=np.uint8)
    words[:, :planes] = raw.reshape(planes, count).T
    return words.view(WORD_DTYPES[itemsize]).reshape(count)


def compress(payload: bytes | bytearray | memoryview, level: int, *, checksum: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_checksum=checksum, write_content_size=True).compress(payload)


def decompress(blob: bytes, max_bytes: int) -> bytes:
    try:
        return bytes(zstandard.ZstdDecompressor().decompress(blob, max_output_size=max_bytes))
    except zstandard.ZstdError as exc:
        raise StoreCorruptError(f"blob does not decompress: {exc}") from exc
