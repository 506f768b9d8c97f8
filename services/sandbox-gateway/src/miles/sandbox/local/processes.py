"""Run one host process in its own process group and stream its output, with a deadline and an output cap.

`stream_process` is the local backend's only way of running an exec. It owns the process from spawn to reap:
- spawned with `close_fds` (no gateway descriptor leaks into a sandbox) in a new session, so that its process
  group is everything it starts that does not call setsid() itself;
- waited for through a pidfd and `wait4` (which gives CPU time), never through asyncio's child watcher;
- on exit, timeout, output cap or an abandoned stream, the whole process group gets SIGKILL — always before the
  group leader is reaped, so the group id can never have been reused by an unrelated process;
- at most `max_output_bytes` per stream are delivered; the first byte beyond kills the group.
Output that arrives after the leader exited is drained for at most DRAIN_S (a process that left the group may
hold the pipe open forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncGenerator, Mapping, Sequence

from miles.sandbox.models import OutputChunk, StreamName
from miles.sandbox.outcome import ProcessOutcome

DRAIN_S = 0.2
STDERR_TAIL_BYTES = 4096


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class _Run:
    """State of one running process; callbacks run on the event loop thread."""

    def __init__(self, process: subprocess.Popen[bytes], max_output_bytes: int) -> None:
        self.process = process
        self.pgid = process.pid
        self.max_output_bytes = max_output_bytes
        self.queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self.delivered: dict[StreamName, int] = {"stdout": 0, "stderr": 0}
        self.stderr_tail = b""
        self.exited = False
        self.timed_out = False
        self.output_capped = False

    def on_data(self, stream: StreamName, data: bytes) -> None:
        room = self.max_output_bytes - self.delivered[stream]
        if len(data) > room:
            data = data[: max(room, 0)]
            if not self.output_capped:
                self.output_capped = True
                self.kill()
        if not data:
            return
        self.delivered[stream] += len(data)
        if stream == "stderr":
            self.stderr_tail = (self.stderr_tail + data)[-STDERR_TAIL_BYTES:]
        self.queue.put_nowait(("chunk", OutputChunk(stream, data)))

    def on_timeout(self) -> None:
        if not self.exited:
            self.timed_out = True
            self.kill()

    def on_exit(self, loop: asyncio.AbstractEventLoop, pidfd: int) -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        # The leader is a zombie now: its pid (= the group id) cannot be reused until we reap it below.
        kill_group(self.pgid)
        _, status, rusage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self.exited = True
        self.queue.put_nowait(("exit", (status, rusage.ru_utime + rusage.ru_stime)))

    def kill(self) -> None:
        if not self.exited:
            kill_group(self.pgid)


class _PipeReader(asyncio.Protocol):
    def __init__(self, run: _Run, stream: StreamName) -> None:
        self.run = run
        self.stream = stream

    def data_received(self, data: bytes) -> None:
        self.run.on_data(self.stream, data)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.run.queue.put_nowait(("eof", self.stream))


def _spawn(
    argv: Sequence[str], env: Mapping[str, str], stdin: bytes, pass_fds: Sequence[int]
) -> tuple[subprocess.Popen[bytes], int, int, int | None]:
    """Popen with our own pipes; returns (process, stdout_r, stderr_r, stdin_w or None)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe() if stdin else (subprocess.DEVNULL, None)
    try:
        process = subprocess.Popen(
            list(argv),
            stdin=in_r,
            stdout=out_w,
            stderr=err_w,
            env=dict(env),
            pass_fds=tuple(pass_fds),
            close_fds=True,
            start_new_session=True,
        )
    except BaseException:
        for fd in (out_r, err_r, in_w):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w, in_r):
            if fd not in (None, subprocess.DEVNULL):
                os.close(fd)
    return process, out_r, err_r, in_w


async def stream_process(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    stdin: bytes,
    timeout_s: float,
    max_output_bytes: int,
    pass_fds: Sequence[int] = (),
) -> AsyncGenerator[OutputChunk | ProcessOutcome, None]:
    """Yield output chunks as they come, then exactly one ProcessOutcome."""
    loop = asyncio.get_running_loop()
    start_s = time.monotonic()
    process, out_r, err_r, in_w = _spawn(argv, env, stdin, pass_fds)
    run = _Run(process, max_output_bytes)
    pidfd = os.pidfd_open(process.pid)
    loop.add_reader(pidfd, run.on_exit, loop, pidfd)
    timer = loop.call_later(timeout_s, run.on_timeout)
    transports: list[asyncio.BaseTransport] = []
    transport: asyncio.BaseTransport
    drain_timer: asyncio.TimerHandle | None = None
    try:
        for fd, stream in ((out_r, "stdout"), (err_r, "stderr")):
            transport, _ = await loop.connect_read_pipe(
                lambda s=stream: _PipeReader(run, s),  # type: ignore[misc]
                os.fdopen(fd, "rb", buffering=0),
            )
            transports.append(transport)
        if in_w is not None:
            writer, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(in_w, "wb", buffering=0))
            transports.append(writer)
            writer.write(stdin)
            writer.close()  # closes once the data is flushed (or the reader is gone)
        open_streams = 2
        exit_info: tuple[int, float] | None = None
        while True:
            kind, payload = await run.queue.get()
            if kind == "chunk":
                assert isinstance(payload, OutputChunk)
                yield payload
            elif kind == "eof":
                open_streams -= 1
            elif kind == "exit":
                exit_info = payload  # type: ignore[assignment]
                drain_timer = loop.call_later(DRAIN_S, run.queue.put_nowait, ("drained", None))
            if exit_info is not None and (open_streams == 0 or kind == "drained"):
                break
        status, cpu_s = exit_info
        code = os.waitstatus_to_exitcode(status)
        yield ProcessOutcome(
            exit_code=code if code >= 0 else -1,
            signal=-code if code < 0 else 0,
            wall_s=time.monotonic() - start_s,
            cpu_s=cpu_s,
            timed_out=run.timed_out,
            output_capped=run.output_capped,
            stdout_bytes=run.delivered["stdout"],
            stderr_bytes=run.delivered["stderr"],
            stderr_tail=run.stderr_tail,
        )
    finally:
        timer.cancel()
        if drain_timer is not None:
            drain_timer.cancel()
        run.kill()  # an abandoned stream (client gone) must not leave the process running
        for transport in transports:
            transport.close()
