"""Terminal agent in the Terminus pattern: the model writes one shell command per turn, the agent runs it in a
sandbox and injects the output as a `user` message; at the end the task's check runs in the same sandbox and
its exit code is the reward (returned by the agent: the job's reward type is `agent`).

Protocol: `<command>ls -la</command>` runs a command, `<done/>` ends the episode; anything else gets a
"could not parse" user message. At most `max_turns` model calls (`metadata["agent_config"]`). It imports
nothing of miles: the model is any OpenAI endpoint, the sandbox the gateway's HTTP API.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
from openai import AsyncOpenAI

COMMAND_RE = re.compile(r"<command>(.*?)</command>", re.DOTALL)
MAX_OUTPUT_CHARS = 2000
UNPARSED = "Could not parse a command. Reply with <command>...</command> or <done/>."


class Sandbox:
    """One sandbox of the gateway's HTTP API for the whole episode."""

    def __init__(self, base_url: str, job_id: str, token: str = "") -> None:
        self.base_url = base_url
        self.job_id = job_id
        self.sandbox_id = ""
        # The job's capability at the gateway: it opens this job's sandboxes and no other job's.
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(timeout=60.0, trust_env=False, headers=headers)

    async def start(self) -> None:
        created = await self.http.post(f"{self.base_url}/v1/sandboxes", json={"job_id": self.job_id, "ttl_s": 600})
        created.raise_for_status()
        self.sandbox_id = created.json()["sandbox_id"]

    async def shell(self, command: str, timeout_s: float = 10.0) -> tuple[int, str]:
        body = {"shell": command, "timeout_s": timeout_s, "stream": False}
        reply = await self.http.post(f"{self.base_url}/v1/sandboxes/{self.sandbox_id}/exec", json=body)
        reply.raise_for_status()
        collected = reply.json()
        return collected["result"]["exit_code"], collected["stdout"] + collected["stderr"]

    async def close(self) -> None:
        if self.sandbox_id:
            await self.http.delete(f"{self.base_url}/v1/sandboxes/{self.sandbox_id}")
        await self.http.aclose()


def terminal_message(exit_code: int, output: str) -> str:
    if len(output) > MAX_OUTPUT_CHARS:
        output = output[:MAX_OUTPUT_CHARS] + "\n[output truncated]"
    return f"Exit code: {exit_code}\nOutput:\n{output}" if output else f"Exit code: {exit_code} (no output)"


async def agent(
    base_url: str, prompt: dict[str, Any], request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    max_turns = int(metadata.get("agent_config", {}).get("max_turns", 6))
    client = AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=3)
    sandbox = Sandbox(metadata["sandbox_url"], metadata["job_id"], metadata.get("sandbox_token", ""))
    messages: list[dict[str, Any]] = list(prompt["messages"])
    num_commands = 0
    try:
        await sandbox.start()
        await sandbox.shell(prompt.get("setup") or "true")
        for _ in range(max_turns):
            completion = await client.chat.completions.create(
                model="policy", messages=messages, extra_body=request_kwargs
            )
            reply = completion.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            if "<done/>" in reply:
                break
            match = COMMAND_RE.search(reply)
            if match is None:
                messages.append(
                    {
                        "role": "user",
                        "content": "Could not parse a command. Reply with <command>...</command> or <done/>.",
                    }
                )
                continue
            num_commands += 1
            exit_code, output = await sandbox.shell(match.group(1).strip())
            messages.append({"role": "user", "content": terminal_message(exit_code, output)})
        check_exit_code, _ = await sandbox.shell(prompt["check"])
    finally:
        await sandbox.close()
        await client.close()
    return {
        "reward": 1.0 if check_exit_code == 0 else 0.0,
        "reward_info": {"check_exit_code": check_exit_code},
        "metadata": {"num_commands": num_commands},
    }
