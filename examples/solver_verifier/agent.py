"""Solver-verifier agent: two roles of one model, each in its own session (the job declares `rollout.roles:
[solver, verifier]`, so the worker opens one session per role and hands them over as `metadata["roles"]`).

1. The solver gets the row's prompt and answers with `Answer: <number>`.
2. The verifier, with its own system prompt and its own conversation, is shown the question and the solver's
   answer and replies `Verdict: correct` or `Verdict: incorrect`.

Both calls are recorded (each session's samples carry their `metadata.role`), and `reward.py` rewards each role
on its own. Written like any OpenAI program: it imports nothing of miles.
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from solver_verifier.reward import parse_answer

VERIFIER_SYSTEM = (
    "You check another assistant's answer to an arithmetic problem. "
    "Reply with a line `Verdict: correct` or `Verdict: incorrect`."
)


async def chat(session: dict[str, str], messages: list[dict[str, Any]], request_kwargs: dict[str, Any]) -> str:
    """One completion in a role's own session (its base_url and api_key)."""
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=3)
    try:
        completion = await client.chat.completions.create(model="policy", messages=messages, extra_body=request_kwargs)
    finally:
        await client.close()
    return completion.choices[0].message.content or ""


def verifier_messages(question: str, solver_reply: str) -> list[dict[str, Any]]:
    answer = parse_answer(solver_reply)
    shown = "(no answer)" if answer is None else f"{answer:g}"
    return [
        {"role": "system", "content": VERIFIER_SYSTEM},
        {"role": "user", "content": f"Problem: {question}\nProposed answer: {shown}\nIs the proposed answer correct?"},
    ]


async def agent(
    base_url: str, prompt: dict[str, Any], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    roles = metadata["roles"]
    solver_reply = await chat(roles["solver"], prompt["messages"], request_kwargs)
    # The verifier is always asked (also about a missing answer): every role's session must call the model.
    verdict_reply = await chat(roles["verifier"], verifier_messages(prompt["question"], solver_reply), request_kwargs)
    return {"answer": solver_reply, "verdict_text": verdict_reply}
