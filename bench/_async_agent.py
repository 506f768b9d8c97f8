"""Agent and reward of `make bench-async`: an episode of `turns` model calls (the row says how many; the bench
draws it from a heavy-tailed distribution), each turn's reply followed by a `continue` user message.

Like every agent it only speaks the OpenAI API. The reward is pseudo-random per episode (so GRPO groups have a
spread and nothing is filtered): the bench measures throughput, not learning.
"""

from __future__ import annotations

import random
from typing import Any

from openai import AsyncOpenAI


async def agent(
    base_url: str, prompt: dict[str, Any], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    turns = int(prompt.get("turns") or metadata.get("turns") or 1)
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
