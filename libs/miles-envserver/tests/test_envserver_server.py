"""The environment server's protocol, in process: routes, status codes, validation both ways."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from miles.envserver.base import Environment
from miles.envserver.protocol import EpisodeRequest, EpisodeResult, ProtocolError, Row
from miles.envserver.server import EnvironmentServer


class CountingEnvironment(Environment):
    connector = "counting"

    def __init__(self) -> None:
        self.setup_done = asyncio.Event()
        self.allow_setup = asyncio.Event()
        self.seen: list[EpisodeRequest] = []

    @property
    def name(self) -> str:
        return "counting"

    async def setup(self) -> None:
        await self.allow_setup.wait()

    def rows(self) -> list[Row]:
        return [Row(prompt=f"count to {i}", label=i, info={"i": i}) for i in range(5)]

    async def run_episode(self, request: EpisodeRequest) -> EpisodeResult:
        self.seen.append(request)
        if request.row.info.get("i") == 4:
            raise RuntimeError("four is unlucky")
        return EpisodeResult(reward=request.row_index / 4, reward_info={"i": request.row_index}, turn_rewards=[0.5])


@pytest.fixture
async def served() -> AsyncIterator[tuple[EnvironmentServer, CountingEnvironment, httpx.AsyncClient]]:
    environment = CountingEnvironment()
    server = EnvironmentServer(environment)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    setup = asyncio.create_task(server.setup())
    async with listener, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        yield server, environment, client
        environment.allow_setup.set()
        await setup


def episode(row_index: int, **overrides: Any) -> dict[str, Any]:
    body = EpisodeRequest("http://x/v1", "key", row_index, Row(prompt="p", info={"i": row_index})).to_json()
    return {**body, **overrides}


async def test_health_is_503_until_setup_then_rows_and_info(served: Any) -> None:
    _, environment, client = served
    assert (await client.get("/healthz")).status_code == 503
    assert (await client.get("/v1/rows")).json()["error"]["code"] == "not_ready"
    environment.allow_setup.set()
    for _ in range(100):
        if (await client.get("/healthz")).status_code == 200:
            break
        await asyncio.sleep(0.01)
    info = (await client.get("/v1/info")).json()
    assert info == {"protocol": "v1", "connector": "counting", "environment": "counting", "num_rows": 5}
    page = (await client.get("/v1/rows", params={"offset": 1, "limit": 2})).json()
    assert page["total"] == 5 and [Row.from_json(r).label for r in page["rows"]] == [1, 2]
    assert (await client.get("/v1/rows", params={"offset": "x"})).status_code == 400
    assert (await client.get("/nowhere")).status_code == 404


async def test_episodes_answer_results_and_precise_errors(served: Any) -> None:
    server, environment, client = served
    environment.allow_setup.set()
    for _ in range(100):
        if server.ready:
            break
        await asyncio.sleep(0.01)
    assert (await client.get("/healthz")).status_code == 200
    answer = await client.post("/v1/episodes", json=episode(2))
    assert answer.status_code == 200
    result = EpisodeResult.from_json(answer.json())
    assert result == EpisodeResult(reward=0.5, reward_info={"i": 2}, turn_rewards=[0.5])
    assert environment.seen[-1].base_url == "http://x/v1" and environment.seen[-1].api_key == "key"
    bad = await client.post("/v1/episodes", json=episode(1, base_url=""))
    assert bad.status_code == 400 and "base_url" in bad.json()["error"]["message"]
    assert (await client.post("/v1/episodes", content=b"{not json")).status_code == 400
    assert (await client.post("/v1/episodes", json=episode(9))).json()["error"]["code"] == "no_such_row"
    failed = await client.post("/v1/episodes", json=episode(4))
    assert failed.status_code == 500 and "four is unlucky" in failed.json()["error"]["message"]
    concurrent = await asyncio.gather(*(client.post("/v1/episodes", json=episode(i)) for i in range(4)))
    assert [EpisodeResult.from_json(a.json()).reward for a in concurrent] == [0.0, 0.25, 0.5, 0.75]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"reward": "high"}, "reward"),
        ({"reward": math.inf}, "reward"),
        ({"reward": True}, "reward"),
        ({}, "reward"),
        ({"reward": 1.0, "reward_info": []}, "reward_info"),
        ({"reward": 1.0, "turn_rewards": [1.0, "x"]}, "turn_rewards"),
    ],
)
def test_a_malformed_result_names_its_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ProtocolError, match=field):
        EpisodeResult.from_json(body)


def test_rows_need_a_prompt_of_text_or_messages() -> None:
    assert Row.from_json({"prompt": [{"role": "user", "content": "hi"}]}).prompt[0]["content"] == "hi"
    for prompt in (None, [], [{"content": "no role"}], 3):
        with pytest.raises(ProtocolError, match=r"row\.prompt"):
            Row.from_json({"prompt": prompt})
