"""Routed experts (MoE routing replay, R3) as SGLang returns them, on the tiny Qwen3-MoE model (4 MoE layers, 8
experts, top-2), in-process: `meta_info.routed_experts` is base64 of little-endian int32 shaped
(seqlen - 1 - routed_experts_start_len, MoE layers, top-k), every row the experts that position went through when it
was fed. Checked against an independent forward of the whole sequence with miles.model (deterministic mode), across
prefix-cache hits, batching, streaming, start lengths, the server flag and the fake model.
(The same through the real routers: test_sglang_routers.py.)"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from miles.common.errors import ConfigError
from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.common.testing.smoke import console_script
from miles.engine.core import Engine
from miles.engine.errors import BadRequestError
from miles.engine.info import ServedModel
from miles.engine.main import build_engine, create_app
from miles.engine.protocol import GenerateRequest
from miles.engine.settings import EngineSettings
from miles.model import CausalLM, Segment, load_model

NUM_MOE_LAYERS, TOP_K, NUM_EXPERTS = 4, 2, 8
MakeEngine = Callable[..., Engine]
_rng = random.Random(3)


def fresh_prompt(n: int) -> list[int]:
    """Random regular token ids, so tests never share cached prefixes by accident."""
    return [_rng.randrange(1000, 150000) for _ in range(n)]


def routing(response: dict[str, Any]) -> np.ndarray:
    raw = base64.b64decode(response["meta_info"]["routed_experts"])
    return np.frombuffer(raw, dtype="<i4").reshape(-1, NUM_MOE_LAYERS, TOP_K)


def seqlen(response: dict[str, Any]) -> int:
    return int(response["meta_info"]["prompt_tokens"] + response["meta_info"]["completion_tokens"])


@pytest.fixture(scope="module")
def reference_model(tiny_moe_model_dir: Path) -> CausalLM:
    return load_model(tiny_moe_model_dir)


def recomputed(model: CausalLM, token_ids: list[int]) -> np.ndarray:
    """The router's picks for every position of one whole sequence, computed apart from the engine."""
    with torch.inference_mode():
        out = model.forward_routed([Segment(torch.tensor(token_ids))], deterministic=True)
    return out.routed_experts.numpy()


@pytest.fixture
def make_moe_engine(tiny_moe_model_dir: Path) -> Iterator[MakeEngine]:
    """In-process engines: the tiny MoE model, deterministic, routed experts on (overridable)."""
    engines: list[Engine] = []

    def make(**overrides: Any) -> Engine:
        values = {"model_path": tiny_moe_model_dir, "deterministic": True, "enable_return_routed_experts": True}
        engine, _ = build_engine(EngineSettings(**{**values, **overrides}), Metrics("engine"))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.scheduler.stop()


@pytest.fixture
def moe_engine(make_moe_engine: MakeEngine) -> Engine:
    return make_moe_engine()


async def generate(engine: Engine, **body: Any) -> Any:
    return await engine.generate(engine.plan(GenerateRequest(**body)))


async def routed(engine: Engine, prompt: list[int], max_new_tokens: int = 6, **extra: Any) -> Any:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, **extra.pop("sampling", {})}
    return await generate(engine, input_ids=prompt, sampling_params=params, return_routed_experts=True, **extra)


def assert_valid(rows: np.ndarray) -> None:
    assert rows.min() >= 0 and rows.max() < NUM_EXPERTS
    assert all(len(set(pair)) == TOP_K for pair in rows.reshape(-1, TOP_K).tolist()), "an expert twice in a top-k"


async def test_routing_equals_an_independent_forward_of_the_whole_sequence(
    moe_engine: Engine, reference_model: CausalLM
) -> None:
    for length, sampling in ((5, {}), (23, {"temperature": 0.8, "sampling_seed": 1}), (40, {"top_k": 20})):
        prompt = fresh_prompt(length)
        for start in (0, length // 2, length):
            out = await routed(moe_engine, prompt, 7, sampling=sampling, routed_experts_start_len=start)
            rows, n = routing(out), seqlen(out)
            assert rows.shape == (n - 1 - start, NUM_MOE_LAYERS, TOP_K)
            assert_valid(rows)
            expected = recomputed(reference_model, prompt + out["output_ids"])[start : n - 1]
            np.testing.assert_array_equal(rows, expected)  # the last sampled token was never fed: no row


async def test_prefix_cache_hit_returns_the_cold_run_routing(moe_engine: Engine, reference_model: CausalLM) -> None:
    prompt = fresh_prompt(30)
    cold = await routed(moe_engine, prompt)
    warm = await routed(moe_engine, prompt)
    assert (cold["meta_info"]["cached_tokens"], warm["meta_info"]["cached_tokens"]) == (0, len(prompt) - 1)
    np.testing.assert_array_equal(routing(warm), routing(cold))
    # The next turn reuses prompt + output[:-1] from the cache: those rows come back from the cached blocks.
    turn2 = prompt + cold["output_ids"] + fresh_prompt(4)
    second = await routed(moe_engine, turn2)
    assert second["meta_info"]["cached_tokens"] == seqlen(cold) - 1
    np.testing.assert_array_equal(routing(second)[: seqlen(cold) - 1], routing(cold))
    np.testing.assert_array_equal(routing(second), recomputed(reference_model, turn2 + second["output_ids"])[:-1])
    assert await moe_engine.flush_cache()
    again = await routed(moe_engine, turn2)
    assert again["meta_info"]["cached_tokens"] == 0
    np.testing.assert_array_equal(routing(again), routing(second))


async def test_concurrent_requests_route_exactly_as_solo_ones(moe_engine: Engine, reference_model: CausalLM) -> None:
    prompts = [fresh_prompt(n) for n in (3, 9, 17, 26, 33, 12)]
    solo = [
        await routed(moe_engine, p, 8, sampling={"temperature": 1.0, "sampling_seed": i}) for i, p in enumerate(prompts)
    ]
    assert await moe_engine.flush_cache()  # the concurrent run computes everything again, batched
    batched = await asyncio.gather(
        *(routed(moe_engine, p, 8, sampling={"temperature": 1.0, "sampling_seed": i}) for i, p in enumerate(prompts))
    )
    for alone, together in zip(solo, batched, strict=True):
        assert together["output_ids"] == alone["output_ids"]
        np.testing.assert_array_equal(routing(together), routing(alone))
    samples = await routed(moe_engine, prompts[2], 5, sampling={"n": 3, "temperature": 1.0}, routed_experts_start_len=2)
    assert len(samples) == 3
    for sample in samples:  # per choice: each sample's own sequence
        expected = recomputed(reference_model, prompts[2] + sample["output_ids"])[2 : seqlen(sample) - 1]
        np.testing.assert_array_equal(routing(sample), expected)


async def test_start_len_is_checked_with_sglang_messages(moe_engine: Engine) -> None:
    prompt = fresh_prompt(6)
    at_prompt_end = await routed(moe_engine, prompt, 4, routed_experts_start_len=6)
    assert routing(at_prompt_end).shape[0] == 3  # the first three output tokens were fed
    none_fed = await routed(moe_engine, prompt, 0, routed_experts_start_len=6)
    assert none_fed["meta_info"]["routed_experts"] == ""  # seqlen - 1 < start_len: no rows
    assert routing(await routed(moe_engine, prompt, 0)).shape[0] == 5
    with pytest.raises(BadRequestError) as too_far:
        await routed(moe_engine, prompt, routed_experts_start_len=7)
    assert too_far.value.message == (
        "recv_req.routed_experts_start_len=7 is higher than the number of input tokens "
        "len(req.origin_input_ids)=6. Please use a smaller routed_experts_start_len."
    )
    with pytest.raises(BadRequestError) as negative:
        await routed(moe_engine, prompt, routed_experts_start_len=-1)
    assert negative.value.message == (
        "recv_req.routed_experts_start_len=-1 is lower than 0. Please use a non-negative routed_experts_start_len."
    )
    batch = {"input_ids": [fresh_prompt(8), fresh_prompt(3)], "return_routed_experts": True}
    with pytest.raises(BadRequestError, match=r"len\(req.origin_input_ids\)=3"):  # checked per batch item
        await generate(moe_engine, **batch, routed_experts_start_len=5)
    ignored = await generate(
        moe_engine, input_ids=prompt, sampling_params={"max_new_tokens": 2}, routed_experts_start_len=-5
    )
    assert "routed_experts" not in ignored["meta_info"]  # not asked for: the start length is not looked at


async def test_without_the_server_flag_requests_are_served_without_routing(make_moe_engine: MakeEngine) -> None:
    engine = make_moe_engine(enable_return_routed_experts=False)
    out = await routed(engine, fresh_prompt(8))
    assert out["meta_info"]["completion_tokens"] == 6 and "routed_experts" not in out["meta_info"]
    with pytest.raises(BadRequestError, match="is higher than the number of input tokens"):  # still checked
        await routed(engine, fresh_prompt(8), routed_experts_start_len=9)


def test_the_flag_on_a_dense_model_refuses_to_start(tiny_model_dir: Path) -> None:
    settings = EngineSettings(model_path=tiny_model_dir, enable_return_routed_experts=True)
    with pytest.raises(ConfigError, match="has no MoE layers"):
        build_engine(settings, Metrics("engine"))


@pytest.mark.integration
def test_a_dense_engine_process_with_the_flag_exits_saying_why(tiny_model_dir: Path) -> None:
    argv = [console_script("miles-engine"), "--model-path", str(tiny_model_dir), "--port", str(free_port())]
    argv += ["--fake-model", "--enable-return-routed-experts"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert "miles-engine: enable_return_routed_experts needs a MoE model" in result.stderr


async def test_the_fake_model_makes_up_deterministic_routing(make_moe_engine: MakeEngine) -> None:
    engine = make_moe_engine(fake_model=True)
    prompt = fresh_prompt(12)
    full = await routed(engine, prompt, 8)
    rows = routing(full)
    assert rows.shape == (seqlen(full) - 1, NUM_MOE_LAYERS, TOP_K)
    assert_valid(rows)
    cached = await routed(engine, prompt, 8, routed_experts_start_len=5)
    assert cached["meta_info"]["cached_tokens"] == len(prompt) - 1
    np.testing.assert_array_equal(routing(cached), rows[5:])


async def test_http_streams_routing_on_the_last_chunk_and_answers_sglang_400s(
    moe_engine: Engine, tiny_moe_model_dir: Path
) -> None:
    settings = EngineSettings(model_path=tiny_moe_model_dir, enable_return_routed_experts=True)
    app = create_app(settings, moe_engine, ServedModel(str(tiny_moe_model_dir), "", "tiny-moe", 0), Metrics("engine"))
    body = {"input_ids": fresh_prompt(10), "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    body |= {"return_routed_experts": True, "routed_experts_start_len": 4}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://engine") as client:
        whole = (await client.post("/generate", json=body)).json()
        streamed = await client.post("/generate", json={**body, "stream": True})
        chunks = [json.loads(e[len("data: ") :]) for e in streamed.text.split("\n\n") if e and e != "data: [DONE]"]
        refused = await client.post("/generate", json={**body, "routed_experts_start_len": 11})
    assert len(chunks) == 6 and not any("routed_experts" in c["meta_info"] for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["routed_experts"] == whole["meta_info"]["routed_experts"]
    assert routing(whole).shape == (10 + 6 - 1 - 4, NUM_MOE_LAYERS, TOP_K)
    assert refused.status_code == 400
    assert "routed_experts_start_len=11 is higher than the number of input tokens" in refused.json()["error"]["message"]
