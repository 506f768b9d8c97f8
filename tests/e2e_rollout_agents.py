"""Agents for the rollout worker's end-to-end tests (loaded by the worker subprocess by dotted path, with
`python_path: [tests]`). Written like user agents: the official openai client, nothing of miles.

`chaos_agent` injects failures on a fixed schedule so a test can predict every episode's status:
`behaviour(prompt_index, sample_index, n)` is the contract between the agent and the test.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from openai import AsyncOpenAI

CHAOS_SCHEDULE = ("raise", "raise", "raise", "raise", "no_call", "timeout", "normal", "normal", "normal", "normal")
"""Per block of 10 consecutive episodes: 40 % raise, 10 % never call the model, 10 % time out, 40 % normal."""


def behaviour(prompt_index: int, sample_index: int, n_samples_per_prompt: int) -> str:
    return CHAOS_SCHEDULE[(prompt_index * n_samples_per_prompt + sample_index) % len(CHAOS_SCHEDULE)]


async def _ask(base_url: str, api_key: str, messages: list[dict[str, Any]], request_kwargs: dict[str, Any]) -> str:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2)
    try:
        completion = await client.chat.completions.create(model="policy", messages=messages, extra_body=request_kwargs)
    finally:
        await client.close()
    return completion.choices[0].message.content or ""


async def chaos_agent(
    base_url: str, prompt: dict[str, Any], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    n = int(metadata["agent_config"]["n_samples_per_prompt"])
    kind = behaviour(metadata["prompt_index"], metadata["sample_index"], n)
    if kind == "raise":
        raise RuntimeError(f"injected failure in episode {metadata['episode_id']}")
    if kind == "no_call":
        return {"reward": 1.0}
    await _ask(base_url, metadata["api_key"], prompt["messages"], request_kwargs)
    if kind == "timeout":
        await asyncio.sleep(3600)
    return {"reward": float(metadata["sample_index"] % 2), "metadata": {"behaviour": kind}}


async def steady_agent(
    base_url: str, prompt: dict[str, Any], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    """Two model calls with a pause between them (so episodes are in flight when a process is killed)."""
    pause_s = float(metadata["agent_config"].get("pause_s", 0.2))
    messages = list(prompt["messages"])
    reply = await _ask(base_url, metadata["api_key"], messages, request_kwargs)
    await asyncio.sleep(pause_s)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Once more."}]
    await _ask(base_url, metadata["api_key"], messages, request_kwargs)
    return {"reward": float(metadata["sample_index"] % 2)}


async def version_bump_agent(
    base_url: str, prompt: dict[str, Any], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    """Two model calls; on the first attempt of an episode the engine's weight version is bumped between them
    (what a weight update landing mid-episode looks like to the rollout side)."""
    engine_url = metadata["agent_config"]["engine_url"]
    messages = list(prompt["messages"])
    reply = await _ask(base_url, metadata["api_key"], messages, request_kwargs)
    if metadata["attempt"] == 0:
        async with httpx.AsyncClient(base_url=engine_url, timeout=30, trust_env=False) as engine:
            current = (await engine.get("/get_weight_version")).json()["weight_version"]
            new_version = str(int(current) + 1 if str(current).isdigit() else 1)
            body = {"new_version": new_version, "abort_all_requests": False}
            (await engine.post("/update_weight_version", json=body)).raise_for_status()
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    await _ask(base_url, metadata["api_key"], messages, request_kwargs)
    return {"reward": 1.0}


async def token_parity_reward(prompt: dict[str, Any], samples: list[Any], agent_result: dict[str, Any]) -> float:
    """1.0 when the sum of the episode's generated token ids is odd, else 0.0: a reward that any model — the fake
    one, a random tiny one — earns about half of the time, so groups carry a learning signal (dynamic sampling
    discards groups whose rewards are all equal) and every step changes the weights."""
    total = 0
    for sample in samples:
        response = sample.tokens[sample.response_start :]
        total += sum(token for token, mask in zip(response, sample.loss_mask, strict=True) if mask)
    return float(total % 2)
