"""Deterministic mode, the basis of true on-policy training: 50 random prompts generated concurrently (so every
decode step batches many sequences, and prefills are batched too), then each full sequence re-scored alone in
one prefill with logprob_start_len — the logprobs must be bit-identical to those returned while generating."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration

NUM_PROMPTS = 50


def _requests() -> list[dict[str, Any]]:
    rng = random.Random(50)
    requests = []
    for i in range(NUM_PROMPTS):
        prompt = [rng.randrange(1000, 150000) for _ in range(rng.randrange(4, 40))]
        params: dict[str, Any] = {"max_new_tokens": rng.randrange(6, 16)}
        params |= {"temperature": 0} if i % 3 == 0 else {"temperature": rng.choice([0.7, 1.0]), "sampling_seed": i}
        requests.append({"input_ids": prompt, "sampling_params": params, "return_logprob": True})
    return requests


async def test_concurrent_generation_logprobs_equal_rescoring_alone_bit_for_bit(
    tiny_model_dir: Path, engine_factory: Any
) -> None:
    with engine_factory(tiny_model_dir, "--deterministic") as engine:
        requests = _requests()
        async with httpx.AsyncClient(base_url=engine.url, timeout=600) as client:
            replies = await asyncio.gather(*(client.post("/generate", json=r) for r in requests))
            generated = [r.json() for r in replies]
            mean_decode_batch = _mean_decode_batch(engine)
            mismatches = []
            for request, result in zip(requests, generated, strict=True):
                prompt = request["input_ids"]
                temperature = request["sampling_params"]["temperature"] or 1.0
                rescore = {
                    "input_ids": prompt + result["output_ids"],
                    "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
                    "return_logprob": True,
                    "logprob_start_len": len(prompt) - 1,
                }
                scored = (await client.post("/generate", json=rescore)).json()
                from_generation = result["meta_info"]["output_token_logprobs"]
                from_scoring = scored["meta_info"]["input_token_logprobs"][1:]
                assert [e[1] for e in from_scoring] == result["output_ids"]
                if from_scoring != from_generation:
                    mismatches.append((prompt, from_generation, from_scoring))
    assert all(len(r["output_ids"]) >= 6 for r in generated)
    assert mean_decode_batch > 4, "the generations were not batched together"
    assert not mismatches, f"{len(mismatches)} of {NUM_PROMPTS} sequences differ; first: {mismatches[0]}"


def _mean_decode_batch(engine: Any) -> float:
    """Sequences per decode step, from the engine's own metrics (tokens decoded / decode forwards)."""
    metrics = engine.client.get("/metrics").text
    count = total = 0.0
    for line in metrics.splitlines():
        if line.startswith('miles_engine_forward_duration_seconds_count{kind="decode"}'):
            count = float(line.split()[-1])
        if line.startswith('miles_engine_computed_tokens_total{kind="decode"}'):
            total = float(line.split()[-1])
    return total / count if count else 0.0
