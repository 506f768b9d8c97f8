"""Multi-turn tool-use agent: the model calls a `calculator` tool (Qwen3 `<tool_call>` JSON), the tool runs in
the sandbox gateway, its output goes back as a `tool` message, until the model answers `Answer: <number>`.

A reply with neither a tool call nor an answer gets one user nudge and the loop goes on (at most `max_turns`
model calls, from `metadata["agent_config"]`). It imports nothing of miles: the model is any OpenAI endpoint,
the sandbox is the gateway's plain HTTP API (`metadata["sandbox_url"]`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
from openai import AsyncOpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with integers, + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
                "required": ["expression"],
            },
        },
    }
]
NUDGE = "Use the calculator tool, then reply with `Answer: <number>`."
ANSWER_RE = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")
EXPRESSION_RE = re.compile(r"^[\d\s+\-*/().]{1,200}$")
# Runs inside the sandbox: the expression arrives on stdin (never in a command line).
CALCULATOR = "import sys; print(eval(sys.stdin.read(), {'__builtins__': {}}, {}))"


class Sandbox:
    """One sandbox of the gateway's HTTP API, created on first use and destroyed by `close`."""

    def __init__(self, base_url: str | None, job_id: str, token: str = "") -> None:
        self.base_url = base_url
        self.job_id = job_id
        self.sandbox_id: str | None = None
        # The job's capability at the gateway: it opens this job's sandboxes and no other job's.
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(timeout=60.0, trust_env=False, headers=headers)

    async def run(self, argv: list[str], stdin: str = "", timeout_s: float = 10.0) -> tuple[int, str]:
        if self.base_url is None:
            return 1, "error: no sandbox is configured for this job"
        if self.sandbox_id is None:
            created = await self.http.post(f"{self.base_url}/v1/sandboxes", json={"job_id": self.job_id, "ttl_s": 300})
            created.raise_for_status()
            self.sandbox_id = created.json()["sandbox_id"]
        body = {"argv": argv, "stdin": stdin, "timeout_s": timeout_s, "stream": False}
        reply = await self.http.post(f"{self.base_url}/v1/sandboxes/{self.sandbox_id}/exec", json=body)
        reply.raise_for_status()
        collected = reply.json()
        return collected["result"]["exit_code"], (collected["stdout"] + collected["stderr"]).strip()

    async def close(self) -> None:
        if self.sandbox_id is not None and self.base_url is not None:
            await self.http.delete(f"{self.base_url}/v1/sandboxes/{self.sandbox_id}")
        await self.http.aclose()


async def calculator(sandbox: Sandbox, arguments: str, timeout_s: float = 5.0) -> tuple[bool, str]:
    """(valid call, tool output); `timeout_s` bounds the sandboxed evaluation."""
    try:
        expression = json.loads(arguments)["expression"]
    except (ValueError, KeyError, TypeError):
        return False, 'error: arguments must be JSON like {"expression": "1 + 2"}'
    if not isinstance(expression, str) or not EXPRESSION_RE.match(expression):
        return False, "error: only digits, spaces and + - * / ( ) are allowed"
    exit_code, output = await sandbox.run(["python3", "-c", CALCULATOR], stdin=expression, timeout_s=timeout_s)
    return exit_code == 0, output if exit_code == 0 else f"error: {output.splitlines()[-1] if output else exit_code}"


async def agent(
    base_url: str, prompt: dict[str, Any], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    config = metadata.get("agent_config", {})
    max_turns = int(config.get("max_turns", 4))
    tool_timeout_s = float(config.get("tool_timeout_s", 5.0))  # a loaded machine (CI) starts sandboxes slowly
    client = AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=3)
    sandbox = Sandbox(metadata.get("sandbox_url"), metadata["job_id"], metadata.get("sandbox_token", ""))
    messages: list[dict[str, Any]] = list(prompt["messages"])
    tool_results: list[str] = []
    num_calls = num_valid_calls = 0
    answer = ""
    try:
        for _ in range(max_turns):
            completion = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, extra_body=request_kwargs
            )
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))  # resent unchanged next turn
            if message.tool_calls:
                for call in message.tool_calls:
                    num_calls += 1
                    valid, output = await calculator(sandbox, call.function.arguments, tool_timeout_s)
                    num_valid_calls += valid
                    tool_results.append(output)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
                continue
            answer = message.content or ""
            if ANSWER_RE.search(answer):
                break
            messages.append({"role": "user", "content": NUDGE})
    finally:
        await sandbox.close()
        await client.close()
    stats = {"num_tool_calls": num_calls, "num_valid_tool_calls": num_valid_calls}
    return {"answer": answer, "tool_results": tool_results, "metadata": stats, **stats}
