"""The environment server: a small asyncio HTTP/1.1 server (standard library only) around one `Environment`.

Routes and status codes are those of `protocol.py`. One connection carries one request at a time (keep-alive
allowed); requests on different connections run concurrently on one event loop, so a connector's
`run_episode` must not block it (connectors run blocking package code in threads). Limits: no TLS, no chunked
request bodies, bodies up to `MAX_BODY_BYTES`; it is meant to sit next to its rollout worker (a subprocess on
loopback, or a per-job pod that only the job's workers can reach).
"""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
from typing import Any
from urllib.parse import parse_qs, urlsplit

from miles.envserver.base import Environment
from miles.envserver.protocol import PROTOCOL_VERSION, EpisodeRequest, ProtocolError

log = logging.getLogger("miles.envserver")

MAX_BODY_BYTES = 64 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Payload Too Large", 500: "Internal Server Error"}
_REASONS[503] = "Service Unavailable"


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class EnvironmentServer:
    def __init__(self, environment: Environment) -> None:
        self.environment = environment
        self.ready = False
        self.num_episodes_running = 0

    async def setup(self) -> None:
        await self.environment.setup()
        self.ready = True

    # --- routes --------------------------------------------------------------------------------------------
    def _need_ready(self) -> None:
        if not self.ready:
            raise HttpError(503, "not_ready", "the environment is still being set up")

    async def route(self, method: str, target: str, body: bytes) -> tuple[int, Any]:
        url = urlsplit(target)
        if (method, url.path) == ("GET", "/healthz"):
            self._need_ready()
            return 200, {"status": "ok"}
        if (method, url.path) == ("GET", "/v1/info"):
            self._need_ready()
            return 200, self._info()
        if (method, url.path) == ("GET", "/v1/rows"):
            self._need_ready()
            return 200, self._rows(parse_qs(url.query))
        if (method, url.path) == ("POST", "/v1/episodes"):
            self._need_ready()
            return 200, await self._episode(body)
        raise HttpError(404, "not_found", f"no route {method} {url.path}")

    def _info(self) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL_VERSION,
            "connector": self.environment.connector,
            "environment": self.environment.name,
            "num_rows": len(self.environment.rows()),
        }

    def _rows(self, query: dict[str, list[str]]) -> dict[str, Any]:
        rows = self.environment.rows()
        try:
            offset = int(query.get("offset", ["0"])[0])
            limit = int(query.get("limit", [str(len(rows))])[0])
        except ValueError as exc:
            raise HttpError(400, "bad_request", "offset and limit must be integers") from exc
        if offset < 0 or limit < 0:
            raise HttpError(400, "bad_request", "offset and limit must be >= 0")
        return {"rows": [row.to_json() for row in rows[offset : offset + limit]], "total": len(rows)}

    async def _episode(self, body: bytes) -> dict[str, Any]:
        try:
            request = EpisodeRequest.from_json(json.loads(body or b"null"))
        except (ValueError, ProtocolError) as exc:  # JSONDecodeError is a ValueError
            raise HttpError(400, "bad_request", str(exc)) from exc
        if request.row_index >= len(self.environment.rows()):
            raise HttpError(404, "no_such_row", f"row {request.row_index} of {len(self.environment.rows())}")
        self.num_episodes_running += 1
        try:
            result = await self.environment.run_episode(request)
        except Exception as exc:  # the environment's own code: its error is the episode's error
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-4))
            log.warning("episode failed: %s: %s", type(exc).__name__, str(exc)[:500])
            raise HttpError(500, "environment_error", text[-4000:]) from exc
        finally:
            self.num_episodes_running -= 1
        return result.to_json()

    # --- HTTP/1.1 --------------------------------------------------------------------------------------------
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        request_line = await reader.readline()
        if not request_line:
            return False
        try:
            method, target, version = request_line.decode("latin-1").split()
        except ValueError:
            await _respond(writer, 400, {"error": {"code": "bad_request", "message": "bad request line"}}, False)
            return False
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        length = int(headers.get("content-length", "0") or "0")
        if length > MAX_BODY_BYTES:
            await _respond(writer, 413, {"error": {"code": "too_large", "message": "body too large"}}, False)
            return False
        body = await reader.readexactly(length) if length else b""
        try:
            status, payload = await self.route(method, target, body)
        except HttpError as exc:
            status, payload = exc.status, {"error": {"code": exc.code, "message": exc.message}}
        await _respond(writer, status, payload, keep_alive)
        return keep_alive


async def _respond(writer: asyncio.StreamWriter, status: int, payload: Any, keep_alive: bool) -> None:
    data = json.dumps(payload).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    writer.write(head.encode("latin-1") + data)
    await writer.drain()
