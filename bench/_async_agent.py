"""Agent and reward of `make bench-async`: an episode of `turns` model calls, each reply followed by a `continue`
user message, with `turns` drawn per episode from a heavy-tailed distribution (min(MAX_TURNS, Pareto(ALPHA))), so a
few episodes are much longer than the rest — also within one GRPO group, as the same prompt gives episodes of
different lengths in real tool use.

The draw is seeded by (prompt index, sample index), so the sync and the async run see the same episodes. Like
every agent it only speaks the OpenAI API. The reward is pseudo-random per episode (so GRPO groups have a spread
and nothing is filtered): the bench measures throughput, not learning.
"""

from __future__ import annotations

import random
from typing import Any

from openai import AsyncOpenAI

ALPHA = 1.1
MAX_TURNS = 24


def num_turns(prompt_index: int, sample_index: int) -> int:
    return min(MAX_TURNS, int(random.Random(f"{prompt_index}:{sample_index}").paretovariate(ALPHA)))


async def agent(
    base_url: str, prompt: dict[str, Any], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    turns = num_turns(int(metadata["prompt_index"]), int(metadata["sample_index"]))
    client = AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=3)
    messages: list[dict[str, Any]] = list(prompt["messages"])
    try:
        for _ in range(turns):
            completion = await client.chat.completions.create(
                model="policy", messages=messages, extra_body=request_kwargs
            )
            messages.append(completion.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "continue"})
    finally:
        await client.close()
    return {"answer": "", "turns": turns}


async def reward(prompt: dict[str, Any], samples: list[Any], agent_result: dict[str, Any]) -> float:
    return random.random()
