"""Weight-update payloads accepted by the engine, checked without torch.

`/update_weights_from_disk`: `model_path` is a Hugging Face checkpoint directory with *.safetensors files (one
file, shards with an index, or any set), the same architecture and shapes as the served model, all weights
present. What weight-sync's disk transport writes.

`/update_weights_from_tensor`: `serialized_named_tensors` is a list of strings, each the standard base64 of the
bytes of one safetensors file (`safetensors.torch.save({name: tensor, ...})`), names as in the Hugging Face
checkpoint, any floating dtype (cast to float32). Any subset of the weights may be sent (a delta or one chunk
of a large model); a name must not appear in two entries. `load_format` must be null or "safetensors".
SGLang itself sends torch-pickled CUDA IPC handles here: we deliberately accept no pickle.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
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
