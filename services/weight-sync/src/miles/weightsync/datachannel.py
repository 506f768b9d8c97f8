"""The data plane of the stream transport: one-shot raw TCP connections outside gRPC, negotiated over gRPC.

Python gRPC moves well under half of what a loopback socket moves (every message goes through the C core's
buffers and the asyncio loop), so full weights travel over plain TCP, as transfer engines do:

1. the receiving daemon calls `OpenDataChannel` (gRPC); the serving daemon registers an offer — a random 32-byte
   token, the version's tensors dealt to `num_connections` connections (`wire.shard_assignment`, as FetchWeights
   shards them) — and answers where to connect (the listener on `data_port`) with the tensors and the content
   address;
2. the receiver opens the connections, each sending `MAGIC`, the token and its index; the server checks the
   token (constant time; each index is served once, the offer expires after `timeout_s`), answers `ACK`, sends
   the connection's tensors with `sendall` straight from memoryviews of the stored bytes (no copy in user space)
   and closes;
3. the receiver `recv_into`s each tensor straight into its buffer and hashes every complete tensor in a worker
   thread while the rest arrives (`receive.py`).

Everything up to the last `ACK` is setup: a failure there (refused, unreachable, token rejected) lets the caller
fall back to the gRPC stream. After it, a connection that closes early (truncated), stalls past `timeout_s` or
sends extra bytes fails the transfer (`DataChannelError`); nothing that arrived is used.

Limits: unencrypted like the rest of the daemons' traffic (the token only stops a stray or replayed connection
from taking a transfer); the sending threads hold a reference to the version until they finish or time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from miles.weightsync.errors import DataChannelSetupError
from miles.weightsync.manifest import TensorSpec
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.weights import WeightSet
from miles.weightsync.wire import shard_assignment

log = logging.getLogger(__name__)

MAGIC = b"MILESWS1"
TOKEN_BYTES = 32
HELLO = struct.Struct(f">{len(MAGIC)}s{TOKEN_BYTES}sI")
ACK = b"\x01"
MAX_CONNECTIONS = 64


@dataclass(frozen=True)
class ChannelOffer:
    """What the receiver needs: where to connect, the token, the tensors and how they are dealt."""

    port: int
    token: bytes
    num_connections: int
    weights: WeightSet
    timeout_s: float


def connection_tensors(specs: Sequence[TensorSpec], num_connections: int) -> list[list[int]]:
    """The tensor indexes each connection carries, in header order."""
    per_connection: list[list[int]] = [[] for _ in range(num_connections)]
    for index, connection in enumerate(shard_assignment(specs, num_connections)):
        per_connection[connection].append(index)
    return per_connection


@dataclass
class _Pending:
    offer: ChannelOffer
    tensors: list[list[int]]
    claimed: set[int] = field(default_factory=set)
    expiry: asyncio.TimerHandle | None = None


class DataChannelServer:
    """The listening side: offers, handshakes, and sending threads (blocking sockets: sendall drops the GIL)."""

    def __init__(self, host: str, port: int, metrics: WeightsyncMetrics, timeout_s: float) -> None:
        self.host = host
        self.requested_port = port
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.port = 0
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._pending: list[_Pending] = []
        self._connections: set[socket.socket] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._executor = ThreadPoolExecutor(MAX_CONNECTIONS, thread_name_prefix="weightsync-data")

    @property
    def started(self) -> bool:
        return self._listener is not None

    def start(self) -> None:
        try:
            listener = socket.create_server((self.host, self.requested_port), backlog=MAX_CONNECTIONS)
        except OSError as exc:
            raise DataChannelSetupError(f"cannot listen on data port {self.host}:{self.requested_port}: {exc}") from exc
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accept_task = asyncio.create_task(self._accept_loop())
        log.info("data channel listening", extra={"host": self.host, "port": self.port})

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
        for pending in self._pending:
            if pending.expiry is not None:
                pending.expiry.cancel()
        self._pending.clear()
        for connection in list(self._connections):
            shutdown_quietly(connection)  # wakes a sending thread blocked in sendall
        for task in list(self._tasks):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    def offer(self, weights: WeightSet, num_connections: int) -> ChannelOffer:
        """Register a one-shot transfer of `weights` over up to `num_connections` connections."""
        granted = max(1, min(num_connections, MAX_CONNECTIONS, max(1, len(weights.specs))))
        offer = ChannelOffer(self.port, secrets.token_bytes(TOKEN_BYTES), granted, weights, self.timeout_s)
        pending = _Pending(offer, connection_tensors(weights.specs, granted))
        pending.expiry = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, pending)
        self._pending.append(pending)
        return offer

    def _expire(self, pending: _Pending) -> None:
        if pending in self._pending:
            self._pending.remove(pending)
            missing = pending.offer.num_connections - len(pending.claimed)
            log.warning("data channel offer expired", extra={"missing_connections": missing})

    def _claim(self, hello: bytes) -> tuple[_Pending, int] | None:
        magic, token, index = HELLO.unpack(hello)
        if magic != MAGIC:
            return None
        for pending in self._pending:
            if hmac.compare_digest(pending.offer.token, token):
                if index >= pending.offer.num_connections or index in pending.claimed:
                    return None
                pending.claimed.add(index)
                if len(pending.claimed) == pending.offer.num_connections:  # one-shot: nothing more to claim
                    self._pending.remove(pending)
                    if pending.expiry is not None:
                        pending.expiry.cancel()
                return pending, index
        return None

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: keep serving
                log.warning("data channel accept failed", extra={"error": str(exc)})
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve(connection))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, connection: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._connections.add(connection)
        try:
            connection.setblocking(False)
            hello = await asyncio.wait_for(_recv_exact_async(loop, connection, HELLO.size), self.timeout_s)
            claimed = self._claim(hello) if hello is not None else None
            if claimed is None:
                self.metrics.data_connections.labels("rejected").inc()
                return
            self.metrics.data_connections.labels("accepted").inc()
            pending, index = claimed
            weights = pending.offer.weights
            views = [memoryview(weights.data[weights.specs[i].name]) for i in pending.tensors[index]]
            connection.setblocking(True)
            connection.settimeout(self.timeout_s)
            await loop.run_in_executor(self._executor, _send_all, connection, views)
            self.metrics.served_bytes.labels("data_channel").inc(sum(len(view) for view in views))
        except (OSError, TimeoutError) as exc:
            self.metrics.data_connections.labels("broken").inc()
            log.warning("data channel connection failed", extra={"error": repr(exc)})
        finally:
            self._connections.discard(connection)
            connection.close()


async def _recv_exact_async(loop: asyncio.AbstractEventLoop, connection: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        piece = await loop.sock_recv(connection, size - len(data))
        if not piece:
            return None
        data += piece
    return data


def _send_all(connection: socket.socket, views: Sequence[memoryview]) -> None:
    connection.sendall(ACK)
    for view in views:
        if len(view):
            connection.sendall(view)
    connection.shutdown(socket.SHUT_WR)


def shutdown_quietly(connection: socket.socket) -> None:
    """Shut both directions down (wakes a thread blocked on it); an already closed socket is fine."""
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
