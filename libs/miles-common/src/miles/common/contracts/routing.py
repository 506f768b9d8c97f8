"""Packed MoE routing (Rollout Routing Replay, R3) as common.proto's `RoutedExperts` states it: one shape, one
packer, one unpacker and one shape check for the engine's answer, the session server, the buffer and the trainer.

The engine answers routing as SGLang does (base64 of little-endian int32, `[rows, num_moe_layers, top_k]`); a
sample carries it packed in the narrowest unsigned width the model's expert count allows (1 byte up to 256
experts: a quarter of SGLang's size). Pure Python (`array`), so that services without numpy can use it.

Limits: ids are checked against the expert count where it is known (packing); `routing_problem` checks shape
only, as `sample_problem` does, and the trainer checks ids against its own model.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles.proto.common.v1 import common_pb2

_TYPECODE = {
    common_pb2.ROUTING_DTYPE_UINT8: "B",
    common_pb2.ROUTING_DTYPE_UINT16: "H",
    common_pb2.ROUTING_DTYPE_INT32: "i",
}
_ITEMSIZE = {dtype: array(code).itemsize for dtype, code in _TYPECODE.items()}
_BIG_ENDIAN = sys.byteorder == "big"


class RoutingError(ValueError):
    """Routing that cannot be decoded or packed as stated (a bad engine answer, ids out of range)."""


@dataclass(frozen=True)
class RoutingShape:
    """What one row of routing holds for a model: `top_k` expert ids for each of its `num_layers` MoE layers."""

    num_layers: int
    top_k: int
    num_experts: int

    @property
    def row_width(self) -> int:
        """Ids per token position."""
        return self.num_layers * self.top_k

    @property
    def dtype(self) -> common_pb2.RoutingDtype:
        """The narrowest RoutingDtype that holds every expert id of the model."""
        if self.num_experts <= 1 << 8:
            return common_pb2.ROUTING_DTYPE_UINT8
        if self.num_experts <= 1 << 16:
            return common_pb2.ROUTING_DTYPE_UINT16
        return common_pb2.ROUTING_DTYPE_INT32

    def bytes_per_row(self) -> int:
        return self.row_width * _ITEMSIZE[self.dtype]


def routing_shape_from_hf_config(config: Mapping[str, Any]) -> RoutingShape | None:
    """The routing shape of a Hugging Face Qwen3-MoE `config.json` (None for a dense model): layer i is MoE when it
    is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0, as transformers builds it."""
    num_experts = int(config.get("num_experts") or 0)
    if config.get("model_type") != "qwen3_moe" or num_experts <= 0:
        return None
    step = int(config.get("decoder_sparse_step", 1))
    dense = set(config.get("mlp_only_layers") or ())
    num_layers = sum(
        1 for index in range(int(config["num_hidden_layers"])) if index not in dense and (index + 1) % step == 0
    )
    if num_layers == 0:
        return None
    return RoutingShape(num_layers=num_layers, top_k=int(config["num_experts_per_tok"]), num_experts=num_experts)


def decode_sglang(encoded: str) -> array[int]:
    """The flat int32 ids of an engine's `routed_experts` answer (base64 of little-endian int32)."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RoutingError(f"routed_experts is not base64: {exc}") from exc
    if len(raw) % 4:
        raise RoutingError(f"routed_experts has {len(raw)} bytes, not a whole number of int32")
    ids = array("i")
    ids.frombytes(raw)
    if _BIG_ENDIAN:
        ids.byteswap()
    return ids


def pack(ids: Sequence[int], shape: RoutingShape) -> common_pb2.RoutedExperts:
    """Flat ids, row-major [rows, num_layers, top_k], packed for a sample. Refuses a partial row and ids outside
    [0, num_experts) (-1 is what an engine answers for a position it did not route)."""
    if len(ids) % shape.row_width:
        raise RoutingError(f"{len(ids)} expert ids are not whole rows of {shape.num_layers} x {shape.top_k}")
    narrowed = _narrow_int32_to_uint8(ids, shape)
    if narrowed is not None:
        return common_pb2.RoutedExperts(
            data=narrowed, dtype=shape.dtype, num_layers=shape.num_layers, top_k=shape.top_k
        )
    if ids and not 0 <= min(ids) <= max(ids) < shape.num_experts:
        raise RoutingError(f"expert ids must be within [0, {shape.num_experts}), got [{min(ids)}, {max(ids)}]")
    packed = array(_TYPECODE[shape.dtype], ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return common_pb2.RoutedExperts(
        data=packed.tobytes(), dtype=shape.dtype, num_layers=shape.num_layers, top_k=shape.top_k
    )


def _narrow_int32_to_uint8(ids: Sequence[int], shape: RoutingShape) -> bytes | None:
    """The fast path of `pack` for what an engine answers (int32) and a model of at most 256 experts: byte slices
    instead of a Python-level pass over every id (a turn of a large MoE is ~10^5 ids). None when it does not
    apply or an id is out of range (`pack` then says which)."""
    if not isinstance(ids, array) or ids.typecode != "i" or _BIG_ENDIAN:
        return None
    if shape.dtype != common_pb2.ROUTING_DTYPE_UINT8 or not ids:
        return None
    raw = ids.tobytes()
    low = raw[0::4]
    if any(raw[offset::4].count(0) != len(low) for offset in (1, 2, 3)):  # negative or >= 256
        return None
    return low if max(low) < shape.num_experts else None


def unpack(routed: common_pb2.RoutedExperts) -> array[int]:
    """The flat ids of packed routing (row-major [num_rows, num_layers, top_k]), widened to int32."""
    if routed.dtype not in _TYPECODE:
        raise RoutingError(f"unknown routing dtype {routed.dtype}")
    ids = array(_TYPECODE[routed.dtype])
    ids.frombytes(routed.data)
    if _BIG_ENDIAN:
        ids.byteswap()
    return ids if ids.typecode == "i" else array("i", ids)


def num_rows(routed: common_pb2.RoutedExperts) -> int:
    """Token positions the routing covers (assumes `routing_problem` found nothing)."""
    return len(routed.data) // (routed.num_layers * routed.top_k * _ITEMSIZE[routed.dtype])


def routing_problem(sample: common_pb2.Sample) -> tuple[str, str] | None:
    """(field, message) of the first shape problem of the sample's routing, or None (also when it has none):
    a known dtype, positive layers and top_k, and exactly len(tokens) - 1 whole rows."""
    if not sample.HasField("rollout_routed_experts"):
        return None
    routed = sample.rollout_routed_experts
    name = "rollout_routed_experts"
    if routed.dtype not in _TYPECODE:
        return f"{name}.dtype", f"{name}.dtype {routed.dtype} is not a known RoutingDtype"
    if routed.num_layers <= 0 or routed.top_k <= 0:
        return name, f"{name} needs num_layers > 0 and top_k > 0, got {routed.num_layers} and {routed.top_k}"
    bytes_per_row = routed.num_layers * routed.top_k * _ITEMSIZE[routed.dtype]
    expected_rows = len(sample.tokens) - 1
    if len(routed.data) != expected_rows * bytes_per_row:
        return (
            f"{name}.data",
            f"{name}.data has {len(routed.data)} bytes, need len(tokens) - 1 = {expected_rows} rows of "
            f"{routed.num_layers} layers x {routed.top_k} experts x {_ITEMSIZE[routed.dtype]} bytes",
        )
    return None
