"""Single-turn math agent: one chat completion, its text is the answer (scored by the `numeric` verifier).

Written like any OpenAI program: it imports nothing of miles.
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI


async def agent(
    base_url: str, prompt: dict[str, Any], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    client = AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=3)
    try:
        completion = await client.chat.completions.create(
            model="policy", messages=prompt["messages"], extra_body=request_kwargs
        )
    finally:
        await client.close()
    return {"answer": completion.choices[0].message.content or ""}
