"""Writing safetensors bytes and files from raw tensor bytes, without torch.

The format: an 8-byte little-endian header length, a JSON header ({name: {dtype, shape, data_offsets}},
"__metadata__"), padded with spaces to a multiple of 8, then the tensors' bytes back to back in header order.
The disk transport writes files in it; the delta and stream transports send it base64-encoded to
/update_weights_from_tensor (services/engine/src/miles/engine/weights.py).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

from miles.weightsync.manifest import SAFETENSORS_DTYPE, TensorBytes, TensorSpec


def safetensors_header(specs: Sequence[TensorSpec]) -> bytes:
    """The length prefix and JSON header for `specs`, data laid out in order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": SAFETENSORS_DTYPE[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.num_bytes],
        }
        offset += spec.num_bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def encode_safetensors(specs: Sequence[TensorSpec], data: Mapping[str, TensorBytes]) -> bytes:
    """One safetensors file's bytes holding `specs` (raw bytes from `data`)."""
    return b"".join([safetensors_header(specs), *(data[spec.name] for spec in specs)])


def write_safetensors_file(path: Path, specs: Sequence[TensorSpec], data: Mapping[str, TensorBytes]) -> None:
    """Write `specs` as one safetensors file, tensor by tensor (no second copy of the weights in memory)."""
    with path.open("wb") as handle:
        handle.write(safetensors_header(specs))
        for spec in specs:
            handle.write(data[spec.name])
