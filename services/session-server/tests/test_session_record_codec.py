"""Stored turn records (record_codec.py): every field round-trips exactly, null logprobs included, records stored
as JSON before the binary layout still load, and decoding a long record never holds the GIL in one long call."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable

import pytest

from miles.session.record_codec import MAGIC, decode_record, encode_record
from miles.session.records import UNPACK_SLICE_ITEMS, FinishType, TurnRecord, dumps


def record(num_tokens: int, *, nulls: bool = False, seed: int = 0) -> TurnRecord:
    rng = random.Random(seed)
    logprobs: list[float | None] = [-rng.random() * 20 for _ in range(num_tokens)]
    if nulls and num_tokens:
        logprobs[0] = logprobs[-1] = None
    ids = [rng.randrange(0, 2**31 - 1) for _ in range(num_tokens)]
    return TurnRecord(3, 41, 2, ids, logprobs, "v7", 11, 41, FinishType.LENGTH, "</s>", 9, 1700000000123, 0.25, 5)


@pytest.mark.parametrize("num_tokens", [0, 1, UNPACK_SLICE_ITEMS, UNPACK_SLICE_ITEMS * 2 + 3])
@pytest.mark.parametrize("nulls", [False, True])
def test_a_record_round_trips_exactly(num_tokens: int, nulls: bool) -> None:
    original = record(num_tokens, nulls=nulls)
    stored = encode_record(original)
    assert stored.startswith(MAGIC)
    assert decode_record(stored) == original
    assert decode_record(stored).to_json() == original.to_json()  # the GET's view: same JSON, same float bits


def test_a_record_stored_as_json_before_the_binary_layout_still_loads() -> None:
    original = record(5, nulls=True)
    assert decode_record(dumps(original.to_json()).encode()) == original
    assert decode_record(dumps(original.to_json())) == original


def test_a_truncated_record_is_refused_not_misread() -> None:
    stored = encode_record(record(10))
    with pytest.raises(ValueError, match="does not hold 10 tokens"):
        decode_record(stored[:-8])


def _longest_stall_s(work: Callable[[], object]) -> float:
    """Longest gap between the ticks of a 1 ms ticker thread while `work` runs here (a GIL held in one call)."""
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    work()
    done.set()
    ticker.join()
    return max(gaps)


def test_decoding_a_long_record_holds_the_gil_far_shorter_than_json_does() -> None:
    """500k tokens: json.loads of the JSON record is one C call holding the GIL throughout; the binary record is
    decoded in slices. Compared side by side (a ratio, not a wall-clock bound)."""
    original = record(500_000)
    as_json, stored = dumps(original.to_json()), encode_record(original)
    json_stall = min(_longest_stall_s(lambda: json.loads(as_json)) for _ in range(2))
    binary_stall = min(_longest_stall_s(lambda: decode_record(stored)) for _ in range(2))
    assert binary_stall * 4 < json_stall, (binary_stall, json_stall)
