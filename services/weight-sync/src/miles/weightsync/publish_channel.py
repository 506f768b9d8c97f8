"""The publish direction of the data channel, daemon side: the trainer pushes a new version's raw tensor bytes
over one-shot TCP connections straight into the assembler's buffers, outside gRPC (as fetches, datachannel.py).

1. `OpenPublishChannel` (gRPC) checks the header as PublishWeights does; `offer` then registers the publish — a
   publish_id, a random 32-byte token, the tensors dealt to the granted connections (`connection_tensors`, as
   fetches deal them) — on the listener that serves fetches (`DataChannelServer`, hello magic `PUBLISH_MAGIC`);
2. connection i sends the hello; `_claim` checks the token in constant time (a repeated or out-of-range index with
   the right token fails the publish), the daemon answers `ACK`, and a thread `recv_into`s the connection's
   tensors in header order straight into their buffers (`PublishAssembler.receive_buffer`: no copy), hands each
   complete tensor to a hashing thread while the rest arrives, reads until the trainer shuts its side down, and
   answers `DONE` when exactly the expected bytes came;
3. `CommitPublish` (`finish`) waits for every connection (at most `timeout_s`) and every hash, checks the content
   address and returns the checked version; the core stores it.

A connection that closes early (truncated), sends too much, stalls for `timeout_s` or breaks, and a claim with the
right token but a repeated index, fail the whole publish: its other connections are shut down, its buffers freed,
and `finish` raises the first error (InvalidPublishError, field "commit"); nothing is stored. A wrong token is
refused without the ACK (it names no publish). An offer whose connections did not all arrive within `timeout_s`
is dropped (CommitPublish: NOT_FOUND), as is one not committed within `timeout_s` after its transfer ended or failed.

Limits: plain TCP (the token stops stray and replayed connections, not an eavesdropper); each pending publish may
hold up to its version's bytes (max_publish_bytes), pending publishes are not bounded together — buffers are only
allocated as their bytes arrive, and dropped offers free them.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from miles.common.aio import wait_event
from miles.common.errors import NotFoundError
from miles.weightsync.datachannel import (
    ACK,
    DONE,
    MAX_CONNECTIONS,
    PUBLISH_MAGIC,
    TOKEN_BYTES,
    DataChannelServer,
    ServeConnection,
    connection_tensors,
    granted_connections,
    shutdown_quietly,
)
from miles.weightsync.errors import DataChannelError, InvalidPublishError
from miles.weightsync.manifest import manifest_digest
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.publish import PublishAssembler, PublishedVersion

log = logging.getLogger(__name__)
_HASH_THREADS = 2


@dataclass(frozen=True)
class PublishOffer:
    """What the trainer needs: the publish's id, where to connect, the token and the granted connections."""

    publish_id: str
    port: int
    token: bytes
    num_connections: int
    timeout_s: float


@dataclass(eq=False)
class _Publish:
    """One offered publish. Changed on the event loop only, except the bytes (and hashes) the threads add."""

    offer: PublishOffer
    assembler: PublishAssembler | None  # None once failed or dropped: its buffers are freed
    tensors: list[list[int]]
    opened_s: float
    claimed: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    connections: set[socket.socket] = field(default_factory=set)
    hashes: list[Future[None]] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)  # every connection finished, or the publish failed
    error: InvalidPublishError | None = None
    timer: asyncio.TimerHandle | None = None


class PublishChannel:
    """Publish offers on a DataChannelServer's listener, their receiving threads, and their commit."""

    def __init__(self, server: DataChannelServer, metrics: WeightsyncMetrics) -> None:
        self.server = server
        self.metrics = metrics
        self.timeout_s = server.timeout_s
        self._publishes: dict[str, _Publish] = {}
        self._receivers = ThreadPoolExecutor(MAX_CONNECTIONS, thread_name_prefix="weightsync-publish")
        self._hashers = ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="weightsync-publish-hash")
        server.add_handler(PUBLISH_MAGIC, self._claim)

    def offer(self, assembler: PublishAssembler, num_connections: int) -> PublishOffer:
        """Register a one-shot publish of `assembler`'s tensors over up to `num_connections` connections."""
        granted = granted_connections(num_connections, len(assembler.specs))
        token = secrets.token_bytes(TOKEN_BYTES)
        offer = PublishOffer(secrets.token_hex(16), self.server.port, token, granted, self.timeout_s)
        publish = _Publish(offer, assembler, connection_tensors(assembler.specs, granted), time.perf_counter())
        self._publishes[offer.publish_id] = publish
        self._set_timer(publish, self._expire)
        return offer

    async def finish(self, publish_id: str, manifest_sha256: str) -> PublishedVersion:
        """The checked version once every connection finished (at most timeout_s) and every tensor matched its
        sha256. NotFoundError: unknown, expired or already committed; InvalidPublishError: a failed transfer, a
        tensor that does not match its sha256, or a wrong manifest_sha256."""
        publish = self._publishes.pop(publish_id, None)
        if publish is None:
            raise NotFoundError(
                f"no pending publish {publish_id!r} (unknown, expired or already committed)", field="publish_id"
            )
        self._cancel_timer(publish)
        if not await wait_event(publish.done, self.timeout_s):
            missing = _missing(publish)
            what = f"data connections {missing} did not arrive" if missing else "the transfer did not end"
            self._fail(
                publish, InvalidPublishError(f"{what} within {self.timeout_s:g} s of CommitPublish", field="commit")
            )
        assembler, publish.assembler = publish.assembler, None
        if publish.error is not None:
            raise publish.error
        assert assembler is not None  # only a failed or dropped publish has none
        if manifest_sha256 != manifest_digest([spec.sha256 for spec in assembler.specs]):
            raise InvalidPublishError("manifest_sha256 does not match the tensors' checksums", field="manifest_sha256")
        await asyncio.gather(*(asyncio.wrap_future(future) for future in publish.hashes))
        published = assembler.commit(manifest_sha256)
        self.metrics.observe_phase("receive", time.perf_counter() - publish.opened_s)
        return published

    def close(self) -> None:
        publishes = list(self._publishes.values())
        self._publishes.clear()
        for publish in publishes:
            self._cancel_timer(publish)
            self._fail(publish, InvalidPublishError("the daemon is shutting down", field="commit"))
        self._receivers.shutdown(wait=False, cancel_futures=True)
        self._hashers.shutdown(wait=False, cancel_futures=True)

    def _claim(self, token: bytes, index: int) -> ServeConnection | None:
        for publish in self._publishes.values():
            if not hmac.compare_digest(publish.offer.token, token):
                continue
            if publish.error is not None:
                return None
            if index >= publish.offer.num_connections or index in publish.claimed:
                what = "connected twice" if index in publish.claimed else "is out of range"
                self._fail(publish, InvalidPublishError(f"data connection {index} {what}", field="commit"))
                return None
            publish.claimed.add(index)
            if len(publish.claimed) == publish.offer.num_connections:
                self._cancel_timer(publish)  # all arrived in time; from here each connection's stall is bounded
            return partial(self._serve, publish, index)
        return None

    async def _serve(self, publish: _Publish, index: int, connection: socket.socket) -> None:
        publish.connections.add(connection)
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._receivers, self._receive, publish, index, connection)
        except BaseException as exc:
            error = _transfer_error(index, exc, self.timeout_s)
            self._fail(publish, error)
            if isinstance(exc, OSError | InvalidPublishError):
                raise DataChannelError(error.message) from exc
            raise
        finally:
            publish.connections.discard(connection)
        publish.finished.add(index)
        if len(publish.finished) == publish.offer.num_connections and publish.error is None:
            publish.done.set()
            if publish.offer.publish_id in self._publishes:  # not being committed yet: it must be within timeout_s
                self._set_timer(publish, self._forget)

    def _receive(self, publish: _Publish, index: int, connection: socket.socket) -> None:
        """One connection's tensors into their buffers (blocking; recv_into and sha256 drop the GIL)."""
        assembler = publish.assembler
        if assembler is None:
            raise InvalidPublishError("the publish failed before this connection started", field="commit")
        connection.sendall(ACK)
        received_bytes = self.metrics.published_bytes.labels("data_channel")
        for tensor_index in publish.tensors[index]:
            spec = assembler.specs[tensor_index]
            with assembler.receive_buffer(tensor_index) as view:
                _recv_exactly(connection, view, index, spec.name)
            assembler.mark_received(tensor_index)
            received_bytes.inc(spec.num_bytes)
            publish.hashes.append(self._hashers.submit(assembler.check_tensor, tensor_index))
        if connection.recv(1):
            raise InvalidPublishError(f"data connection {index} sent more bytes than its tensors hold", field="commit")
        connection.sendall(DONE)

    def _fail(self, publish: _Publish, error: InvalidPublishError) -> None:
        """Fail the publish (the first error stays): stop its connections, free its buffers."""
        if publish.error is None:
            publish.error = error
            log.warning("publish over the data channel failed", extra={"error": error.message})
        publish.assembler = None
        for connection in publish.connections:
            shutdown_quietly(connection)
        for future in publish.hashes:
            future.cancel()
        publish.done.set()
        if publish.offer.publish_id in self._publishes:
            self._set_timer(publish, self._forget)  # CommitPublish gets the error until then

    def _expire(self, publish: _Publish) -> None:
        self._publishes.pop(publish.offer.publish_id, None)
        expired = f"the publish channel expired: data connections {_missing(publish)} did not arrive within"
        self._fail(publish, InvalidPublishError(f"{expired} {self.timeout_s:g} s", field="commit"))

    def _forget(self, publish: _Publish) -> None:
        if self._publishes.pop(publish.offer.publish_id, None) is not None and publish.error is None:
            log.warning("a publish received over the data channel was never committed; dropped")
        publish.assembler = None

    def _set_timer(self, publish: _Publish, callback: Callable[[_Publish], None]) -> None:
        self._cancel_timer(publish)
        publish.timer = asyncio.get_running_loop().call_later(self.timeout_s, callback, publish)

    @staticmethod
    def _cancel_timer(publish: _Publish) -> None:
        if publish.timer is not None:
            publish.timer.cancel()
            publish.timer = None


def _missing(publish: _Publish) -> list[int]:
    return sorted(set(range(publish.offer.num_connections)) - publish.claimed)


def _recv_exactly(connection: socket.socket, view: memoryview, index: int, name: str) -> None:
    received = 0
    while received < len(view):
        num = connection.recv_into(view[received:])
        if num == 0:
            raise InvalidPublishError(
                f"data connection {index} closed after {received} of {len(view)} bytes of {name!r} (truncated)",
                field="commit",
            )
        received += num


def _transfer_error(index: int, exc: BaseException, timeout_s: float) -> InvalidPublishError:
    if isinstance(exc, InvalidPublishError):
        return exc
    if isinstance(exc, TimeoutError):
        return InvalidPublishError(f"data connection {index} stalled for {timeout_s:g} s", field="commit")
    return InvalidPublishError(f"data connection {index} broke: {exc!r}", field="commit")
