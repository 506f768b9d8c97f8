"""A connector for the worker's failure tests (run by the real environment server in a subprocess).

Each row's `info.mode` says what its episode does: `ok` (one model call through the session, reward = 1.0 when
the reply is not empty), `raise` (the environment raises), `crash` (the server process exits mid-episode),
`hang` (blocks the server's event loop: /healthz stops answering), `bad` (a reward that is not a number),
`slow` (sleeps without blocking, past any short timeout). `args.num_ok` rows of mode ok follow the others.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from miles.envserver.base import Environment
from miles.envserver.model_client import chat
from miles.envserver.protocol import EpisodeRequest, EpisodeResult, Row

MODES = ("raise", "crash", "hang", "bad", "slow")


class _BadResult(EpisodeResult):
    def to_json(self) -> dict[str, Any]:
        return {"reward": "high", "reward_info": {}}


class MisbehavingEnvironment(Environment):
    connector = "misbehaving"

    def __init__(self, num_ok: int) -> None:
        self._rows = [Row(prompt=f"Say {mode}.", label=mode, info={"mode": mode}) for mode in MODES]
        self._rows += [Row(prompt=f"Count to {i}.", label=str(i), info={"mode": "ok"}) for i in range(num_ok)]

    @property
    def name(self) -> str:
        return "misbehaving"

    def rows(self) -> list[Row]:
        return self._rows

    async def run_episode(self, request: EpisodeRequest) -> EpisodeResult:
        mode = request.row.info["mode"]
        reply = await chat(request, [{"role": "user", "content": str(request.row.prompt)}])
        if mode == "raise":
            raise RuntimeError("the environment broke")
        if mode == "crash":
            os._exit(3)
        if mode == "hang":
            time.sleep(3600)  # noqa: ASYNC251 - blocks the loop on purpose: a hung environment
        if mode == "bad":
            return _BadResult(reward=0.0)
        if mode == "slow":
            await asyncio.sleep(3600)
        content = reply.get("content") or ""
        return EpisodeResult(reward=1.0 if content else 0.0, reward_info={"num_chars": len(content)})


def create(args: dict[str, Any]) -> Environment:
    return MisbehavingEnvironment(int(args.get("num_ok", 2)))
