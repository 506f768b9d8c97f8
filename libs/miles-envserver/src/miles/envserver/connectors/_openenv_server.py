"""The two halves of an OpenEnv session for the `openenv` connector: the OpenEnv server process it starts, and
OpenEnv's own client (GenericEnvClient over /ws) with errors the connector can act on.

The server's output goes to this server's stderr (prefixed `[openenv]`) and its last lines are kept for error
messages. It runs in its own process group (stop() ends a `command`'s children too) and gets SIGTERM when this
process dies (Linux: PR_SET_PDEATHSIG; the worker may SIGKILL this server). Limit: a grandchild of a `command`
outlives a SIGKILL of this process.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import functools
import json
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

_PR_SET_PDEATHSIG = 1
_TAIL_LINES = 40
_CHUNK_BYTES = 65536
CAPACITY_REACHED, VALIDATION_ERROR = "CAPACITY_REACHED", "VALIDATION_ERROR"
"""OpenEnv's WSErrorCode values the connector acts on (a session refused; an action its schema refused)."""


class OpenEnvServerError(RuntimeError):
    """The OpenEnv server answered an error message (its WSErrorCode in `code`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"OpenEnv server error {code}: {message}")
        self.code = code


class OpenEnvConnectionError(ConnectionError):
    """The OpenEnv session could not be opened or was lost (the server is gone, or a message timed out)."""


@functools.cache
def client_class() -> type[Any]:
    """OpenEnv's GenericEnvClient (any server, JSON actions), raising its error messages as OpenEnvServerError and
    transport failures as OpenEnvConnectionError. Built on first use: importing openenv is slow (FastAPI, MCP)."""
    from openenv.core.generic_client import GenericEnvClient

    class Client(GenericEnvClient):  # type: ignore[misc]
        async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
            try:
                await self._send(message)
            except Exception as exc:  # the connect, or a socket the server closed: after its last word?
                response = await self._last_word()
                if response is None:
                    raise OpenEnvConnectionError(f"{type(exc).__name__}: {exc}") from exc
            else:
                try:
                    response = await self._receive()
                except Exception as exc:  # a closed socket, the message timeout: the session is gone
                    raise OpenEnvConnectionError(f"{type(exc).__name__}: {exc}") from exc
            if response.get("type") == "error":
                data = response.get("data") or {}
                raise OpenEnvServerError(str(data.get("code", "UNKNOWN")), str(data.get("message", data)))
            return response

        async def _last_word(self) -> dict[str, Any] | None:
            """A message the server sent before it closed the session (a session it refused: CAPACITY_REACHED
            comes right after the WebSocket opens, and the server closes it)."""
            ws: Any = getattr(self, "_ws", None)
            try:
                message: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), timeout=1.0))
            except Exception:
                return None
            return message

        async def disconnect(self) -> None:
            """OpenEnv's close message, then the server's own close: closing first makes the server log a
            traceback for each session (0.3.0 answers the close message on a socket already closed)."""
            ws: Any = getattr(self, "_ws", None)
            if ws is None:
                return
            with contextlib.suppress(Exception):
                await self._send({"type": "close"})
                await asyncio.wait_for(ws.wait_closed(), timeout=5.0)
            with contextlib.suppress(Exception):
                await ws.close()
            self._ws = None

    return Client


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@functools.cache
def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to SIGTERM the child when this process dies (its worker may SIGKILL it).
    libc is loaded here, before the fork: the child only calls prctl, which is safe beside threads."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    return lambda: libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


async def healthy(url: str) -> bool:
    """Whether OpenEnv's GET /health answers {"status": "healthy"}."""
    try:
        body = await asyncio.to_thread(get_json, f"{url}/health", 2.0)
    except (OSError, ValueError):  # URLError, refused, a timeout, not JSON yet
        return False
    return isinstance(body, dict) and body.get("status") == "healthy"


async def wait_healthy(
    url: str,
    timeout_s: float,
    exited: Callable[[], str | None] = lambda: None,
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Until the server at `url` is healthy; RuntimeError when `exited()` says its process ended, or on timeout."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await healthy(url):
        if exited() is not None:
            if drain is not None:
                await drain()
            raise RuntimeError(exited())
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"the OpenEnv server at {url} did not answer /health within {timeout_s:g} s")
        await asyncio.sleep(0.2)


@dataclass
class ServerProcess:
    """An OpenEnv server started by the connector (`argv` listens on 127.0.0.1:`port`)."""

    argv: list[str]
    env: dict[str, str]
    port: int
    process: asyncio.subprocess.Process | None = None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))
    _pump: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def exited(self) -> str | None:
        """None while it runs, else how it ended and its last output."""
        if self.process is None or self.process.returncode is None:
            return None
        last = "\n".join(self.tail) or "(no output)"
        return f"the OpenEnv server exited with code {self.process.returncode}; its last output:\n{last}"

    async def start(self, timeout_s: float) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            start_new_session=True,  # its own process group: stop() ends a command's children too
            preexec_fn=_die_with_parent_hook(),
        )
        self._pump = asyncio.create_task(self._forward_output())
        await wait_healthy(self.url, timeout_s, self.exited, drain=self.drain)

    async def _forward_output(self) -> None:
        """Copy its output line by line (never stopping early: a full pipe would block the server)."""
        assert self.process is not None and self.process.stdout is not None
        pending = b""
        while chunk := await self.process.stdout.read(_CHUNK_BYTES):
            *lines, pending = (pending + chunk).split(b"\n")
            if len(pending) > _CHUNK_BYTES:  # a line without end in sight: show what came
                lines, pending = [*lines, pending], b""
            for line in lines:
                self._emit(line)
        if pending:
            self._emit(pending)

    def _emit(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip()
        self.tail.append(line)
        print(f"[openenv] {line}", file=sys.stderr, flush=True)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait briefly for a process that is ending (a lost session): `exited()` then has its code and output."""
        waits: list[Awaitable[Any]] = [asyncio.shield(task) for task in (self._pump,) if task is not None]
        if self.process is not None:
            waits.append(self.process.wait())
        with contextlib.suppress(asyncio.TimeoutError):  # Python 3.10's is not the builtin TimeoutError
            await asyncio.wait_for(asyncio.gather(*waits), timeout=timeout_s)

    async def stop(self, grace_s: float = 10.0) -> None:
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout=grace_s)
            except asyncio.TimeoutError:  # noqa: UP041 - Python 3.10's is not TimeoutError
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
