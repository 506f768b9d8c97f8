"""The receiving side of a data channel (datachannel.py): connect, recv_into the tensors' buffers, verify.

`DataChannelReceiver` is blocking (one thread per connection: recv_into drops the GIL, so connections and the
hashing of finished tensors run in parallel); `receive_over_data_channel` runs it for asyncio and returns a
`PublishedVersion` only when every tensor is complete and matches its sha256 and the header matches the
content address. Cancelling it shuts the sockets down, which ends the threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from miles.weightsync.datachannel import MAGIC, close_all, connection_tensors, open_connections, shutdown_quietly
from miles.weightsync.errors import DataChannelError, InvalidPublishError
from miles.weightsync.manifest import TensorBytes, TensorSpec, manifest_digest
from miles.weightsync.publish import PublishedVersion

_HASH_THREADS = 2


class DataChannelReceiver:
    """One transfer: `connect()` (setup: raises DataChannelSetupError), then `receive()` once."""

    def __init__(
        self, host: str, port: int, token: bytes, specs: Sequence[TensorSpec], num_connections: int, timeout_s: float
    ) -> None:
        self.address = (host, port)
        self.token = token
        self.specs = tuple(specs)
        self.tensors = connection_tensors(self.specs, num_connections)
        self.timeout_s = timeout_s
        self._sockets: list[socket.socket] = []
        self._aborted = threading.Event()
        self._lock = threading.Lock()
        self._first_error: BaseException | None = None

    def connect(self) -> None:
        """Open every connection, then wait for each ACK (the handshakes overlap): after this, the transfer runs
        or fails, with no fallback."""
        open_connections(
            self._sockets, self.address, MAGIC, self.token, len(self.tensors), self.timeout_s, self._aborted
        )

    def receive(
        self, buffers: Sequence[memoryview] | None = None, on_tensor: Callable[[int, memoryview], None] | None = None
    ) -> list[memoryview]:
        """Every tensor's bytes (into `buffers` when given, else fresh bytearrays allocated just before each
        tensor arrives); `on_tensor(index, view)` runs in the receiving thread as each tensor completes."""
        views: list[memoryview] = list(buffers) if buffers is not None else [memoryview(b"")] * len(self.specs)
        with ThreadPoolExecutor(len(self._sockets), thread_name_prefix="weightsync-recv") as pool:
            futures = [
                pool.submit(self._receive_connection, connection, indexes, views, buffers is None, on_tensor)
                for connection, indexes in zip(self._sockets, self.tensors, strict=True)
            ]
            for future in futures:
                future.add_done_callback(self._abort_on_error)
        self.close()
        first = self._first_error  # the cause; the others saw their sockets shut down by abort()
        if first is not None:
            if isinstance(first, DataChannelError | InvalidPublishError):
                raise first
            raise DataChannelError(f"data channel transfer failed: {first!r}") from first
        return views

    def _receive_connection(
        self,
        connection: socket.socket,
        indexes: Sequence[int],
        views: list[memoryview],
        allocate: bool,
        on_tensor: Callable[[int, memoryview], None] | None,
    ) -> None:
        for index in indexes:
            size = self.specs[index].num_bytes
            if allocate:
                views[index] = memoryview(bytearray(size))
            view = views[index]
            if len(view) != size:
                raise ValueError(f"buffer of tensor {index} has {len(view)} bytes, not {size}")
            received = 0
            while received < size:
                num = connection.recv_into(view[received:])
                if num == 0:
                    name = self.specs[index].name
                    raise DataChannelError(
                        f"data channel closed after {received} of {size} bytes of {name!r} (truncated)"
                    )
                received += num
            if on_tensor is not None:
                on_tensor(index, view)
        if connection.recv(1):
            raise DataChannelError("the data channel sent more bytes than the tensors hold")

    def _abort_on_error(self, future: Future[None]) -> None:
        error = future.exception()
        if error is not None:
            with self._lock:
                if self._first_error is None:
                    self._first_error = error
            self.abort()

    def abort(self) -> None:
        """Stop every connection (from another thread): blocked receives return and the transfer fails."""
        self._aborted.set()
        for connection in self._sockets:
            shutdown_quietly(connection)

    def close(self) -> None:
        close_all(self._sockets)


def _receive_verified(receiver: DataChannelReceiver) -> list[memoryview]:
    specs = receiver.specs
    with ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="weightsync-hash") as hashers:
        digests: dict[int, Future[str]] = {}

        def on_tensor(index: int, view: memoryview) -> None:
            digests[index] = hashers.submit(lambda: hashlib.sha256(view).hexdigest())

        views = receiver.receive(on_tensor=on_tensor)
        for index, spec in enumerate(specs):
            digest = digests[index].result() if index in digests else hashlib.sha256(views[index]).hexdigest()
            if digest != spec.sha256:
                raise InvalidPublishError(
                    f"tensor {spec.name!r} does not match its sha256", field=f"header.tensors[{index}].sha256"
                )
    return views


async def receive_over_data_channel(
    receiver: DataChannelReceiver, *, job_id: str, version: int, manifest_sha256: str
) -> PublishedVersion:
    """Connect (DataChannelSetupError: fall back), receive and verify every tensor; the checked version."""
    if manifest_sha256 != manifest_digest([spec.sha256 for spec in receiver.specs]):
        raise InvalidPublishError("the offer's tensors do not match its manifest_sha256", field="manifest_sha256")
    try:
        await asyncio.to_thread(receiver.connect)
        views = await asyncio.to_thread(_receive_verified, receiver)
    except asyncio.CancelledError:
        receiver.abort()
        raise
    data: dict[str, TensorBytes] = {}
    for spec, view in zip(receiver.specs, views, strict=True):
        assert isinstance(view.obj, bytearray)  # allocated by receive()
        data[spec.name] = view.obj
    return PublishedVersion(job_id, version, version - 1, receiver.specs, data)
