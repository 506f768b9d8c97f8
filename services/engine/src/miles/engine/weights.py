"""Weight-update payloads accepted by the engine, checked without torch.

`/update_weights_from_disk`: `model_path` is a Hugging Face checkpoint directory with *.safetensors files (one
file, shards with an index, or any set), the same architecture and shapes as the served model, all weights
present. What weight-sync's disk transport writes.

`/update_weights_from_tensor`: `serialized_named_tensors` is a list of strings, each the standard base64 of the
bytes of one safetensors file (`safetensors.torch.save({name: tensor, ...})`), names as in the Hugging Face
checkpoint, any floating dtype (cast to float32). Any subset of the weights may be sent (a delta or one chunk
of a large model); a name must not appear in two entries. `load_format` must be null or "safetensors".
SGLang itself sends torch-pickled CUDA IPC handles here: we deliberately accept no pickle.

`/update_weights_from_distributed`: `names`, `dtypes`, `shapes` announce the tensors the trainer then
broadcasts over a weight-update group (distributed.py); `check_tensor_specs` decides before anything is
received whether they can be (floating dtypes only, a size bound), the model checks names and shapes after.
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.engine.errors import WeightUpdateError

TENSOR_LOAD_FORMATS = (None, "safetensors")
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def decode_payloads(serialized_named_tensors: list[str], load_format: str | None) -> list[bytes]:
    """The safetensors bytes of each base64 entry; raises WeightUpdateError on anything else."""
    if load_format not in TENSOR_LOAD_FORMATS:
        raise WeightUpdateError(f"load_format {load_format!r} is not supported (use null or 'safetensors')")
    if not serialized_named_tensors:
        raise WeightUpdateError("serialized_named_tensors is empty")
    payloads = []
    for index, entry in enumerate(serialized_named_tensors):
        try:
            payloads.append(base64.b64decode(entry, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise WeightUpdateError(f"serialized_named_tensors[{index}] is not valid base64: {exc}") from exc
    return payloads


def parse_safetensors_header(data: bytes) -> dict[str, dict[str, Any]]:
    """The tensor entries (name -> {dtype, shape, data_offsets}) of safetensors bytes, bounds-checked."""
    if len(data) < 8:
        raise WeightUpdateError("safetensors payload shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(len(data) - 8, _MAX_HEADER_BYTES):
        raise WeightUpdateError("safetensors header length exceeds the payload")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightUpdateError(f"safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WeightUpdateError("safetensors header is not a JSON object")
    body_len = len(data) - 8 - header_len
    entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in entries.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1] <= body_len):
            raise WeightUpdateError(f"tensor {name!r} has invalid data_offsets")
    return entries


def check_checkpoint_dir(model_path: str) -> Path:
    """The directory if it exists and holds safetensors weights; raises WeightUpdateError otherwise."""
    path = Path(model_path)
    if not path.is_dir():
        raise WeightUpdateError(f"model_path {model_path!r} is not a directory")
    if not any(path.glob("*.safetensors")):
        raise WeightUpdateError(f"no *.safetensors files in {model_path!r}")
    return path


FLOAT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
"""The dtypes (torch names without "torch.") of tensors received by broadcast and of /weights_checker, with
their element sizes."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor announced by /update_weights_from_distributed, received by broadcast in announcement order."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * FLOAT_DTYPE_BYTES[self.dtype]


def check_tensor_specs(
    names: list[str], dtypes: list[str], shapes: list[list[int]], max_total_bytes: int
) -> list[TensorSpec]:
    """The announced tensors if they can be received (names unique, known dtypes, non-negative shapes, at most
    `max_total_bytes` in all); raises WeightUpdateError. Whether the names and shapes fit the model is checked
    after receiving: every broadcast must be consumed first."""
    if not names:
        raise WeightUpdateError("names is empty")
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError(
            f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)} and {len(shapes)}"
        )
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if dtype not in FLOAT_DTYPE_BYTES:
            raise WeightUpdateError(f"tensor {name!r} has dtype {dtype!r}; supported: {', '.join(FLOAT_DTYPE_BYTES)}")
        if any(size < 0 for size in shape):
            raise WeightUpdateError(f"tensor {name!r} has a negative size in shape {shape}")
        specs.append(TensorSpec(name, dtype, tuple(shape)))
    duplicates = sorted(name for name, count in collections.Counter(names).items() if count > 1)
    if duplicates:
        raise WeightUpdateError(f"tensor {duplicates[0]!r} is listed twice")
    total_bytes = sum(spec.num_bytes for spec in specs)
    if total_bytes > max_total_bytes:
        raise WeightUpdateError(f"the tensors hold {total_bytes} bytes, more than this model's {max_total_bytes}")
    return specs
