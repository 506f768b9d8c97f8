"""The trainer's side of a publish over the data channel (the daemon's side is publish_channel.py): connect, send
every tensor's raw bytes, wait for the daemon's DONE on every connection.

`PublishSender` is blocking, one thread per connection: `sendall` drops the GIL, so the connections — and the
conversion of each connection's next tensor to the publish dtype — run in parallel. `connect()` is the setup
(DataChannelSetupError: refused, unreachable, token refused; the caller falls back to PublishWeights); after the
ACKs, `send()` ends with every connection's DONE or raises (DataChannelError for the channel, or whatever
producing a tensor's bytes raised) — no fallback then: the daemon has failed the publish and stores nothing.
Cancelling shuts the sockets down, which ends the threads.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from miles.weightsync.datachannel import (
    DONE,
    PUBLISH_MAGIC,
    close_all,
    connection_tensors,
    open_connections,
    shutdown_quietly,
)
from miles.weightsync.errors import DataChannelError
from miles.weightsync.manifest import TensorSpec

TensorBuffer = Callable[[int], memoryview]
"""The raw bytes of tensor `index` in the publish dtype (called from the sending threads, one tensor at a time
per connection)."""


class PublishSender:
    """One publish transfer: `connect()` once, then `send()` once."""

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
        """Open every connection and wait for each ACK (DataChannelSetupError: fall back)."""
        open_connections(
            self._sockets, self.address, PUBLISH_MAGIC, self.token, len(self.tensors), self.timeout_s, self._aborted
        )

    def send(self, tensor_buffer: TensorBuffer) -> None:
        """Every connection's tensors in header order, then its shutdown and the daemon's DONE."""
        with ThreadPoolExecutor(len(self._sockets), thread_name_prefix="weightsync-send") as pool:
            futures = [
                pool.submit(self._send_connection, index, connection, tensor_buffer)
                for index, connection in enumerate(self._sockets)
            ]
            for future in futures:
                future.add_done_callback(self._abort_on_error)
        close_all(self._sockets)
        first = self._first_error  # the cause; the others saw their sockets shut down by abort()
        if isinstance(first, OSError):
            raise DataChannelError(f"the publish data channel broke: {first!r}") from first
        if first is not None:
            raise first

    def _send_connection(self, index: int, connection: socket.socket, tensor_buffer: TensorBuffer) -> None:
        for tensor_index in self.tensors[index]:
            if self._aborted.is_set():
                raise DataChannelError("the transfer was aborted")
            with tensor_buffer(tensor_index) as view:
                expected = self.specs[tensor_index].num_bytes
                if view.nbytes != expected:
                    raise ValueError(f"tensor {tensor_index} has {view.nbytes} bytes, its header says {expected}")
                if view.nbytes:
                    connection.sendall(view)
        connection.shutdown(socket.SHUT_WR)
        if connection.recv(len(DONE)) != DONE:
            raise DataChannelError(f"the daemon closed data connection {index} without confirming its bytes")

    def _abort_on_error(self, future: Future[None]) -> None:
        error = future.exception()
        if error is not None:
            with self._lock:
                if self._first_error is None:
                    self._first_error = error
            self.abort()

    def abort(self) -> None:
        """Stop every connection (from another thread): blocked sends return and the transfer fails."""
        self._aborted.set()
        for connection in self._sockets:
            shutdown_quietly(connection)
