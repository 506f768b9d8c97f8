"""The data plane of the daemons: one-shot raw TCP connections outside gRPC, negotiated over gRPC.

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

The same listener takes the other direction, publishes from the trainer (`publish_channel.py`): the hello's magic
picks the direction (`MAGIC` = fetch, `PUBLISH_MAGIC` = publish), each direction claims its own offers
(`add_handler`).

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
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from miles.weightsync.errors import DataChannelError, DataChannelSetupError
from miles.weightsync.manifest import TensorSpec
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.weights import WeightSet
from miles.weightsync.wire import shard_assignment

log = logging.getLogger(__name__)

MAGIC = b"MILESWS1"  # fetch: the daemon sends a version's tensors
PUBLISH_MAGIC = b"MILESWP1"  # publish: the trainer sends a new version's tensors
TOKEN_BYTES = 32
HELLO = struct.Struct(f">{len(MAGIC)}s{TOKEN_BYTES}sI")
ACK = b"\x01"
DONE = b"\x02"  # publish: the daemon has every byte of the connection's tensors
MAX_CONNECTIONS = 64
SETUP_TIMEOUT_S = 10.0  # connect + ACK: a port that a firewall drops must not hold a transfer for the whole timeout

ServeConnection = Callable[[socket.socket], Awaitable[None]]
ClaimHandler = Callable[[bytes, int], ServeConnection | None]
"""Claims connection `index` of the offer whose token is `token` (on the event loop, so claims are atomic) and
returns how to serve it after the ACK is due, or None to refuse it (closed without ACK)."""


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


def granted_connections(num_connections: int, num_tensors: int) -> int:
    """Connections an offer grants: as asked, at most MAX_CONNECTIONS and one per tensor, at least one."""
    return max(1, min(num_connections, MAX_CONNECTIONS, max(1, num_tensors)))


def open_connections(
    sockets: list[socket.socket],
    address: tuple[str, int],
    magic: bytes,
    token: bytes,
    num_connections: int,
    timeout_s: float,
    cancelled: threading.Event,
) -> None:
    """The caller's side of the setup (blocking): open every connection into `sockets` (so that another thread
    can shut them down meanwhile), send each hello, then wait for each ACK (the handshakes overlap). Raises
    DataChannelSetupError (refused, unreachable, token refused, cancelled) after closing what it opened; after it
    returns, each socket's timeout is `timeout_s` (the longest stall)."""
    try:
        for index in range(num_connections):
            if cancelled.is_set():
                raise DataChannelSetupError("the transfer was cancelled")
            connection = socket.create_connection(address, timeout=min(timeout_s, SETUP_TIMEOUT_S))
            sockets.append(connection)
            connection.sendall(HELLO.pack(magic, token, index))
        for index, connection in enumerate(sockets):
            if connection.recv(len(ACK)) != ACK:
                raise DataChannelSetupError(f"the daemon refused data connection {index} (token or expiry)")
            connection.settimeout(timeout_s)
    except OSError as exc:
        close_all(sockets)
        raise DataChannelSetupError(f"data channel to {address[0]}:{address[1]}: {exc}") from exc
    except DataChannelSetupError:
        close_all(sockets)
        raise


def close_all(sockets: Sequence[socket.socket]) -> None:
    for connection in sockets:
        connection.close()


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
        self._handlers: dict[bytes, ClaimHandler] = {}

    def add_handler(self, magic: bytes, claim: ClaimHandler) -> None:
        """Route connections whose hello starts with `magic` to `claim` (the fetch direction is built in)."""
        self._handlers[magic] = claim

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
        granted = granted_connections(num_connections, len(weights.specs))
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

    def _route(self, hello: bytes) -> ServeConnection | None:
        magic, token, index = HELLO.unpack(hello)
        if magic == MAGIC:
            claimed = self._claim(hello)
            return partial(self._send_tensors, *claimed) if claimed is not None else None
        handler = self._handlers.get(magic)
        return handler(token, index) if handler is not None else None

    async def _serve(self, connection: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._connections.add(connection)
        try:
            connection.setblocking(False)
            hello = await asyncio.wait_for(_recv_exact_async(loop, connection, HELLO.size), self.timeout_s)
            serve = self._route(hello) if hello is not None else None
            if serve is None:
                self.metrics.data_connections.labels("rejected").inc()
                return
            self.metrics.data_connections.labels("accepted").inc()
            connection.setblocking(True)
            connection.settimeout(self.timeout_s)
            await serve(connection)
        except (OSError, DataChannelError) as exc:
            self.metrics.data_connections.labels("broken").inc()
            log.warning("data channel connection failed", extra={"error": repr(exc)})
        finally:
            self._connections.discard(connection)
            connection.close()

    async def _send_tensors(self, pending: _Pending, index: int, connection: socket.socket) -> None:
        weights = pending.offer.weights
        views = [memoryview(weights.data[weights.specs[i].name]) for i in pending.tensors[index]]
        await asyncio.get_running_loop().run_in_executor(self._executor, _send_all, connection, views)
        self.metrics.served_bytes.labels("data_channel").inc(sum(len(view) for view in views))


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
