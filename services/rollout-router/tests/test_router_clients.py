"""One connection pool per engine: reused per URL, and closed only after a removed engine's requests finished."""

from __future__ import annotations

import asyncio
from typing import Any

from miles.router.clients import EngineClients
from miles.router.settings import RouterSettings


async def test_a_retired_engines_client_closes_once_its_requests_finished(make_pool: Any, until: Any) -> None:
    _, _, (engine, other) = make_pool(2)
    clients = EngineClients(RouterSettings())
    client, other_client = clients.get(engine.url), clients.get(other.url)
    assert clients.get(engine.url) is client and other_client is not client
    await engine.slots.acquire(1, 1.0)  # a request still in flight when the engine is deregistered
    clients.retire(engine)
    assert clients.get(engine.url) is not client  # registered again: a fresh pool
    await asyncio.sleep(0.05)
    assert not client.is_closed
    engine.slots.release(1)
    await until(lambda: client.is_closed)
    await clients.aclose()
    assert other_client.is_closed
