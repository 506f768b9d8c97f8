"""The engine's final /generate object as a Completion: the miles-engine's per-token weight-version spans."""

from __future__ import annotations

from typing import Any

import pytest

from miles.session.errors import UpstreamMalformedError
from miles.session.generate_wire import parse_finished


def body(spans: Any) -> dict[str, Any]:
    meta = {
        "finish_reason": {"type": "length", "length": 4},
        "weight_version": "8",
        "completion_tokens": 4,
        "output_token_logprobs": [[-0.5, token, None] for token in (5, 6, 7, 8)],
    }
    if spans is not None:
        meta["miles_weight_version_spans"] = spans
    return {"output_ids": [5, 6, 7, 8], "meta_info": meta}


def test_spans_of_a_call_carried_across_an_update_are_kept_and_one_span_or_none_is_none() -> None:
    carried = parse_finished(body([[0, 1, "7"], [1, 4, "8"]]), num_prompt_tokens=3, latency_s=0.1)
    assert carried.weight_version == "8" and carried.weight_version_spans == [(0, 1, "7"), (1, 4, "8")]
    assert parse_finished(body([[0, 4, "8"]]), num_prompt_tokens=3, latency_s=0.1).weight_version_spans is None
    assert parse_finished(body(None), num_prompt_tokens=3, latency_s=0.1).weight_version_spans is None


@pytest.mark.parametrize(
    "spans",
    [[[0, 2, "7"], [1, 4, "8"]], [[0, 5, "8"]], [[2, 2, "8"]], [["0", 4, "8"]], [[0, 4]], "0-4:8"],
    ids=["overlapping", "past_the_output", "empty", "not_an_int", "no_version", "not_a_list"],
)
def test_spans_that_do_not_tile_the_output_in_order_are_a_protocol_error(spans: Any) -> None:
    with pytest.raises(UpstreamMalformedError, match="miles_weight_version_spans"):
        parse_finished(body(spans), num_prompt_tokens=3, latency_s=0.1)
