"""The engine core in-process with the fake model: scheduling, radix-cache accounting, aborts, pauses and
weight-update barriers. The fake model is deterministic (greedy output depends only on the context), so a
sequence that was paused, retracted or batched must come out exactly as an undisturbed one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from miles.common.telemetry import Metrics
from miles.engine.core import Engine
from miles.engine.errors import BadRequestError
from miles.engine.main import build_engine
from miles.engine.protocol import GenerateRequest
from miles.engine.settings import EngineSettings

MakeEngine = Callable[..., Engine]


@pytest.fixture
def make_engine(tiny_model_dir: Path) -> Iterator[MakeEngine]:
    engines: list[Engine] = []

    def make(**overrides: Any) -> Engine:
        settings = EngineSettings(model_path=tiny_model_dir, fake_model=True, **overrides)
        engine, _ = build_engine(settings, Metrics("engine"))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.scheduler.stop()


async def generate(engine: Engine, **body: Any) -> Any:
    return await engine.generate(engine.plan(GenerateRequest(**body)))


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **extra}


async def test_multi_turn_prefix_reuse_gives_sglang_cached_tokens(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = list(range(100, 130))
    first = await generate(engine, input_ids=prompt, sampling_params=greedy(8))
    assert first["meta_info"]["cached_tokens"] == 0
    turn2 = prompt + first["output_ids"] + [7, 8, 9, 10, 11]
    second = await generate(engine, input_ids=turn2, sampling_params=greedy(6))
    assert second["meta_info"]["cached_tokens"] == len(prompt) + len(first["output_ids"]) - 1
    turn3 = turn2 + second["output_ids"] + [12, 13]
    third = await generate(engine, input_ids=turn3, sampling_params=greedy(4))
    assert third["meta_info"]["cached_tokens"] == len(turn2) + len(second["output_ids"]) - 1
    again = await generate(engine, input_ids=prompt, sampling_params=greedy(8))
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert again["output_ids"] == first["output_ids"]


async def test_logprob_start_len_caps_the_cache_match(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = list(range(200, 240))
    await generate(engine, input_ids=prompt, sampling_params=greedy(2))
    capped = await generate(
        engine, input_ids=prompt, sampling_params=greedy(2), return_logprob=True, logprob_start_len=15
    )
    assert capped["meta_info"]["cached_tokens"] == 15
    entries = capped["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(prompt) - 15
    assert entries[0][0] is None and all(e[0] is not None for e in entries[1:])
    assert [e[1] for e in entries] == prompt[15:]
    scored = await generate(
        engine, input_ids=prompt, sampling_params=greedy(2), return_logprob=True, logprob_start_len=0
    )
    assert scored["meta_info"]["cached_tokens"] == 0


async def test_n_samples_prewarm_the_prompt_and_get_fresh_rids(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = list(range(300, 320))
    samples = await generate(engine, input_ids=prompt, rid="mine", sampling_params={"max_new_tokens": 3, "n": 3})
    assert isinstance(samples, list) and len(samples) == 3
    assert all(s["meta_info"]["cached_tokens"] == len(prompt) - 1 for s in samples)
    ids = {s["meta_info"]["id"] for s in samples}
    assert len(ids) == 3 and "mine" not in ids


async def test_lru_eviction_under_the_token_budget(make_engine: MakeEngine) -> None:
    engine = make_engine(max_total_tokens=100)
    a, b, c = (list(range(k, k + 40)) for k in (1000, 2000, 3000))
    for prompt in (a, b):
        await generate(engine, input_ids=prompt, sampling_params=greedy(1))
    await generate(engine, input_ids=a, sampling_params=greedy(1))  # a is now more recent than b
    assert engine.scheduler.snapshot().num_cached_tokens == 80
    await generate(engine, input_ids=c, sampling_params=greedy(1))  # needs 41: evicts b, the LRU leaf
    assert (await generate(engine, input_ids=a, sampling_params=greedy(1)))["meta_info"]["cached_tokens"] == 39
    assert (await generate(engine, input_ids=b, sampling_params=greedy(1)))["meta_info"]["cached_tokens"] == 0
    assert engine.scheduler.snapshot().num_used_tokens <= 100


async def test_new_requests_join_a_running_batch(make_engine: MakeEngine) -> None:
    engine = make_engine(fake_decode_token_cost_s=0.005)
    long_task = asyncio.create_task(generate(engine, input_ids=[5, 6, 7], sampling_params=greedy(120, ignore_eos=True)))
    await asyncio.sleep(0.1)
    short = await generate(engine, input_ids=[8, 9], sampling_params=greedy(3))
    assert not long_task.done(), "the short request finished while the long one was still decoding"
    long = await long_task
    assert short["meta_info"]["completion_tokens"] == 3
    assert long["meta_info"]["completion_tokens"] == 120
    alone = await generate(engine, input_ids=[5, 6, 7], sampling_params=greedy(120, ignore_eos=True))
    assert alone["output_ids"] == long["output_ids"]


@pytest.mark.parametrize("mixed_chunk", [True, False])
async def test_a_new_request_is_prefilled_in_the_running_batch_s_decode_step(
    make_engine: MakeEngine, mixed_chunk: bool
) -> None:
    """SGLang's mixed chunk: the short request's prefill shares a forward with the long one's next decode step, so
    the long one needs no more forwards than alone; without it that prefill is a forward of its own."""
    engine = make_engine(fake_forward_cost_s=0.004, enable_mixed_chunk=mixed_chunk)
    slept_s: list[float] = []

    def sleep(seconds: float) -> None:
        slept_s.append(seconds)
        time.sleep(seconds)

    engine.scheduler._runner.sleep = sleep
    long_body = {"input_ids": [5, 6, 7], "sampling_params": greedy(100, ignore_eos=True)}
    alone = await generate(engine, **long_body)
    num_forwards_alone = len(slept_s)
    slept_s.clear()
    long_task = asyncio.create_task(generate(engine, **long_body))
    for _ in range(6000):  # until the long request is decoding (polls for up to 30 s)
        if len(slept_s) >= 2:
            break
        await asyncio.sleep(0.005)
    short = await generate(engine, input_ids=[8, 9, 40, 41], sampling_params=greedy(3))
    assert not long_task.done(), "the long request ended before the short one did"
    together = await long_task
    assert len(slept_s) - num_forwards_alone == (0 if mixed_chunk else 1)
    assert together["output_ids"] == alone["output_ids"]
    short_alone = await generate(engine, input_ids=[8, 9, 40, 41], sampling_params=greedy(3))
    assert short["output_ids"] == short_alone["output_ids"]


async def _generate_together(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Holds the engine while the requests arrive, so they are admitted and decoded as one batch."""
    await engine.pause("abort")
    tasks = [
        asyncio.create_task(generate(engine, input_ids=p, sampling_params=greedy(max_new_tokens, ignore_eos=True)))
        for p in prompts
    ]
    for _ in range(6000):  # polls the scheduler's queue for up to a minute
        if engine.scheduler.snapshot().num_waiting_reqs == len(prompts):
            break
        await asyncio.sleep(0.01)
    assert engine.scheduler.snapshot().num_waiting_reqs == len(prompts)
    await engine.resume()
    await asyncio.gather(*tasks)


async def test_forward_cost_is_per_step_and_token_costs_scale_with_the_batch(make_engine: MakeEngine) -> None:
    """A memory-bound GPU step: 8 requests decoded together cost as many forwards as one alone, each the same."""
    prompts = [[5, 6, 7, 10 + i] for i in range(8)]
    slept_s: list[float] = []
    engine = make_engine(fake_forward_cost_s=0.002)
    engine.scheduler._runner.sleep = slept_s.append
    await _generate_together(engine, prompts[:1], 20)
    num_forwards_alone = len(slept_s)
    slept_s.clear()
    await _generate_together(engine, prompts, 20)
    assert num_forwards_alone >= 20
    assert len(slept_s) == num_forwards_alone, "the 8 requests were not decoded in shared steps"
    assert set(slept_s) == {0.002}

    per_token = make_engine(fake_decode_token_cost_s=0.001)
    slept_s = []
    per_token.scheduler._runner.sleep = slept_s.append
    await _generate_together(per_token, prompts, 20)
    assert max(slept_s) == pytest.approx(8 * 0.001)  # a full decode step costs one token's cost per request


def test_a_request_for_more_sequences_than_run_at_once_is_refused(make_engine: MakeEngine) -> None:
    engine = make_engine(max_running_requests=4)
    for too_many in (
        GenerateRequest(input_ids=[1, 2], sampling_params={"n": 5}),
        GenerateRequest(text=["a"] * 5),
        GenerateRequest(input_ids=[[1], [2], [3]], sampling_params={"n": 2}),
    ):
        with pytest.raises(BadRequestError, match="max_running_requests"):
            engine.plan(too_many)
    assert len(engine.plan(GenerateRequest(input_ids=[[1], [2]], sampling_params={"n": 2})).sequences) == 4


async def test_abort_in_waiting_queue_and_while_running(make_engine: MakeEngine) -> None:
    engine = make_engine(max_running_requests=1, fake_decode_token_cost_s=0.01)
    running = asyncio.create_task(generate(engine, input_ids=[1, 2], rid="run-1", sampling_params=greedy(500)))
    waiting = asyncio.create_task(generate(engine, input_ids=[3, 4], rid="wait-1", sampling_params=greedy(5)))
    await asyncio.sleep(0.2)
    assert await engine.abort("wait", abort_all=False) == 1
    queued = await waiting
    assert queued["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in queued["meta_info"] and queued["output_ids"] == []
    assert await engine.abort("run-1", abort_all=False) == 1
    aborted = await running
    reason = aborted["meta_info"]["finish_reason"]
    assert reason == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert 0 < aborted["meta_info"]["completion_tokens"] < 500
    assert len(aborted["output_ids"]) == aborted["meta_info"]["completion_tokens"]


async def test_pause_abort_answers_in_flight_and_holds_new_requests(make_engine: MakeEngine) -> None:
    engine = make_engine(fake_decode_token_cost_s=0.005)
    running = asyncio.create_task(generate(engine, input_ids=[1, 2, 3], sampling_params=greedy(400)))
    await asyncio.sleep(0.1)
    await engine.pause("abort")
    assert (await running)["meta_info"]["finish_reason"]["type"] == "abort"
    held = asyncio.create_task(generate(engine, input_ids=[4, 5], sampling_params=greedy(4)))
    await asyncio.sleep(0.2)
    assert not held.done()
    assert not await engine.health_generate(1.0)
    await engine.resume()
    assert (await held)["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert await engine.health_generate(5.0)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_then_continue_resumes_the_same_sequence(make_engine: MakeEngine, mode: str) -> None:
    engine = make_engine(fake_decode_token_cost_s=0.003)
    prompt = list(range(50, 80))
    reference = await generate(engine, input_ids=prompt, sampling_params=greedy(150, ignore_eos=True))
    await engine.flush_cache()
    running = asyncio.create_task(generate(engine, input_ids=prompt, sampling_params=greedy(150, ignore_eos=True)))
    await asyncio.sleep(0.15)
    await engine.pause(mode)
    snapshot = engine.scheduler.snapshot()
    if mode == "retract":
        assert (snapshot.num_running_reqs, snapshot.num_waiting_reqs) == (0, 1)
        assert await engine.flush_cache(), "retracted sequences hold no KV, so the cache can be flushed"
    else:
        assert (snapshot.num_running_reqs, snapshot.num_waiting_reqs) == (1, 0)
        assert not await engine.flush_cache(), "flush must fail while a sequence is resident"
    await asyncio.sleep(0.1)
    assert not running.done()
    await engine.resume()
    result = await running
    assert result["output_ids"] == reference["output_ids"]
    assert result["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_a_request_carried_across_an_update_reports_which_weights_sampled_each_token(
    make_engine: MakeEngine, tiny_model_dir: Path, mode: str
) -> None:
    engine = make_engine(fake_decode_token_cost_s=0.003)
    running = asyncio.create_task(generate(engine, input_ids=[1, 2, 3], sampling_params=greedy(150, ignore_eos=True)))
    await asyncio.sleep(0.15)
    await engine.pause(mode)
    await engine.update_weights_from_disk(str(tiny_model_dir), weight_version="v2", abort_all=False, flush_cache=False)
    await engine.resume()
    meta = (await running)["meta_info"]
    spans = meta["miles_weight_version_spans"]
    assert [span[2] for span in spans] == ["default", "v2"] and meta["weight_version"] == "v2"
    assert spans[0][0] == 0 and 0 < spans[0][1] == spans[1][0] < spans[1][1] == 150
    fresh = await generate(engine, input_ids=[4, 5], sampling_params=greedy(5, ignore_eos=True))
    assert fresh["meta_info"]["miles_weight_version_spans"] == [[0, 5, "v2"]]


async def test_weight_update_waits_for_in_flight_requests(make_engine: MakeEngine, tiny_model_dir: Path) -> None:
    engine = make_engine(fake_decode_token_cost_s=0.003)
    before = await generate(engine, input_ids=[9, 9, 9], sampling_params=greedy(20, ignore_eos=True))
    in_flight = asyncio.create_task(generate(engine, input_ids=[1, 2], sampling_params=greedy(100, ignore_eos=True)))
    await asyncio.sleep(0.05)
    update = asyncio.create_task(
        engine.update_weights_from_disk(str(tiny_model_dir), weight_version="v2", abort_all=False, flush_cache=True)
    )
    await asyncio.sleep(0.05)
    queued_after = asyncio.create_task(
        generate(engine, input_ids=[9, 9, 9], sampling_params=greedy(20, ignore_eos=True))
    )
    finished = await in_flight
    assert finished["meta_info"]["weight_version"] == "default"
    assert finished["meta_info"]["completion_tokens"] == 100
    await update
    after = await queued_after
    assert after["meta_info"]["weight_version"] == "v2"
    assert after["meta_info"]["cached_tokens"] == 0, "the update flushed the cache"
    assert after["output_ids"] != before["output_ids"], "new weights give new outputs"


async def test_eos_and_stop_strings(make_engine: MakeEngine) -> None:
    engine = make_engine(fake_eos_probability=1.0)
    eos = await generate(engine, input_ids=[1, 2, 3], sampling_params=greedy(10))
    assert eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": 151645}
    assert eos["output_ids"] == [151645] and eos["text"] == ""
    kept = await generate(
        engine, input_ids=[1, 2, 3], sampling_params=greedy(10, no_stop_trim=True, skip_special_tokens=False)
    )
    assert kept["text"] == "<|im_end|>"
    ignored = await generate(engine, input_ids=[1, 2, 3], sampling_params=greedy(4, ignore_eos=True))
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert ignored["output_ids"] == [151645] * 4
