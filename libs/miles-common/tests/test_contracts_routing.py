"""Packed routing (R3): SGLang's answer decodes, packs in the narrowest width and comes back equal; a sample's
routing must cover exactly len(tokens) - 1 whole rows."""

from __future__ import annotations

import base64
import struct
from array import array

import pytest

from miles.common.contracts import routing
from miles.common.contracts.samples import sample_problem
from miles.proto.common.v1 import common_pb2

TINY = routing.RoutingShape(num_layers=2, top_k=2, num_experts=8)
QWEN3_MOE_CONFIG = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 6,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [5],
    "num_experts": 300,
    "num_experts_per_tok": 8,
}


def sglang_answer(ids: list[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()


def test_an_engine_answer_packs_to_one_byte_per_id_and_unpacks_equal() -> None:
    ids = [0, 7, 3, 4, 5, 6, 1, 2, 6, 7, 0, 1]  # 3 rows x 2 layers x top-2
    decoded = routing.decode_sglang(sglang_answer(ids))
    packed = routing.pack(decoded, TINY)
    assert packed.dtype == common_pb2.ROUTING_DTYPE_UINT8 and len(packed.data) == len(ids)
    assert list(routing.unpack(packed)) == ids and routing.num_rows(packed) == 3


@pytest.mark.parametrize(
    ("num_experts", "dtype", "itemsize"),
    [
        (256, common_pb2.ROUTING_DTYPE_UINT8, 1),
        (257, common_pb2.ROUTING_DTYPE_UINT16, 2),
        (70000, common_pb2.ROUTING_DTYPE_INT32, 4),
    ],
)
def test_the_width_follows_the_expert_count(num_experts: int, dtype: int, itemsize: int) -> None:
    shape = routing.RoutingShape(num_layers=1, top_k=2, num_experts=num_experts)
    packed = routing.pack([0, num_experts - 1], shape)
    assert packed.dtype == dtype and len(packed.data) == 2 * itemsize
    assert list(routing.unpack(packed)) == [0, num_experts - 1]


@pytest.mark.parametrize(
    ("ids", "message"), [([0, 1, 2], "whole rows"), ([0, 1, 8, 0], "within"), ([-1, 0, 0, 0], "within")]
)
def test_packing_refuses_partial_rows_and_ids_out_of_range(ids: list[int], message: str) -> None:
    for given in (ids, array("i", ids)):  # a list, and an engine's int32 answer (the byte-slicing path)
        with pytest.raises(routing.RoutingError, match=message):
            routing.pack(given, TINY)


def test_an_int32_answer_packs_to_what_a_list_of_the_same_ids_packs_to() -> None:
    ids = [7, 0, 255 % 8, 3] * 6
    assert routing.pack(array("i", ids), TINY) == routing.pack(ids, TINY)
    wide = routing.RoutingShape(num_layers=1, top_k=2, num_experts=256)
    assert routing.pack(array("i", [255, 0]), wide).data == bytes([255, 0])


@pytest.mark.parametrize("encoded", ["not base64!", base64.b64encode(b"abc").decode()])
def test_a_bad_engine_answer_is_a_routing_error(encoded: str) -> None:
    with pytest.raises(routing.RoutingError):
        routing.decode_sglang(encoded)


def test_the_shape_of_a_hugging_face_qwen3_moe_config() -> None:
    # layers 1 and 3 are sparse ((i + 1) % 2 == 0); 5 is listed dense
    assert routing.routing_shape_from_hf_config(QWEN3_MOE_CONFIG) == routing.RoutingShape(2, 8, 300)
    assert routing.routing_shape_from_hf_config({"model_type": "qwen3", "num_hidden_layers": 2}) is None


def sample_with_routing(num_tokens: int, num_rows: int) -> common_pb2.Sample:
    sample = common_pb2.Sample(
        tokens=list(range(num_tokens)), response_start=num_tokens, status=common_pb2.SAMPLE_STATUS_COMPLETED
    )
    sample.rollout_routed_experts.CopyFrom(routing.pack([1] * (num_rows * TINY.row_width), TINY))
    return sample


def test_a_sample_needs_one_row_per_token_but_the_last() -> None:
    assert sample_problem(sample_with_routing(5, 4)) is None
    for num_rows in (3, 5):
        problem = sample_problem(sample_with_routing(5, num_rows))
        assert problem is not None and problem.kind == "bad_routing" and problem.field == "rollout_routed_experts.data"


def test_a_sample_with_unusable_routing_metadata_is_refused() -> None:
    sample = sample_with_routing(5, 4)
    sample.rollout_routed_experts.num_layers = 0
    problem = sample_problem(sample)
    assert problem is not None and problem.kind == "bad_routing" and "num_layers > 0" in problem.message
    sample = sample_with_routing(5, 4)
    sample.rollout_routed_experts.dtype = common_pb2.ROUTING_DTYPE_UNSPECIFIED
    problem = sample_problem(sample)
    assert problem is not None and problem.field == "rollout_routed_experts.dtype"
