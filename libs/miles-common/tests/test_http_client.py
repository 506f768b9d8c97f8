"""Connection reuse: an idempotent request survives a pooled connection the server closed; a POST is not resent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from miles.common.http_client import CLIENT_KEEPALIVE_EXPIRY_S, ENGINE_KEEPALIVE_EXPIRY_S, traced_async_client
from miles.common.serve import SERVER_KEEP_ALIVE_S

_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"


class _ClosesOnReuse:
    """Answers the first request on each connection and closes the connection, unanswered, when a second request
    arrives on it: the race of a server closing an idle keep-alive connection just as the client reuses it."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = _content_length(head)
        if length:
            await reader.readexactly(length)
        self.answered.append(head.split(b" ", 1)[0])
        writer.write(_OK)
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
        writer.close()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@pytest.fixture
async def closing_server() -> AsyncIterator[tuple[_ClosesOnReuse, str]]:
    behaviour = _ClosesOnReuse()
    server = await asyncio.start_server(behaviour.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield behaviour, f"http://127.0.0.1:{port}"


async def test_idempotent_request_is_resent_on_a_new_connection(closing_server: tuple[_ClosesOnReuse, str]) -> None:
    behaviour, url = closing_server
    async with traced_async_client(base_url=url) as http:
        assert (await http.get("/a")).text == "ok"
        assert (await http.get("/b")).text == "ok"
        assert (await http.delete("/c")).text == "ok"
    assert behaviour.answered == [b"GET", b"GET", b"DELETE"]
    assert behaviour.connections == 3


async def test_post_on_a_closed_connection_is_not_resent(closing_server: tuple[_ClosesOnReuse, str]) -> None:
    behaviour, url = closing_server
    async with traced_async_client(base_url=url) as http:
        await http.post("/a", content=b"x")
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post("/b", content=b"y")
    assert behaviour.answered == [b"POST"]


async def test_plain_httpx_loses_the_same_get(closing_server: tuple[_ClosesOnReuse, str]) -> None:
    # The control: without the retrying transport this race is a failed request.
    _, url = closing_server
    async with httpx.AsyncClient(base_url=url) as http:
        await http.get("/a")
        with pytest.raises(httpx.RemoteProtocolError):
            await http.get("/b")


def test_clients_drop_idle_connections_before_servers_close_them() -> None:
    assert CLIENT_KEEPALIVE_EXPIRY_S < SERVER_KEEP_ALIVE_S
    assert ENGINE_KEEPALIVE_EXPIRY_S < 5.0  # uvicorn's default keep-alive, which an SGLang engine serves with
