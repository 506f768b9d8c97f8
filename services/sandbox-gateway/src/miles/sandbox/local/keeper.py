"""The keeper process of one local sandbox: started, waited for until the sandbox is set up, watched, killed.

`start_keeper` spawns bwrap, reads the namespace init's pid from bwrap's --info-fd and then waits for the
keeper's own "ready" line, printed by the sandbox's first command: only then are the mounts and pivot_root
done (bwrap reports the pid before its child has finished setting up, and entering the namespaces earlier could
see the host's root). The keeper's exit is noticed through a pidfd and reaped at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable, Mapping

from miles.sandbox.errors import SandboxStartFailedError

MAX_ERROR_CHARS = 2000


class Keeper:
    """A started keeper: its bwrap process, the host pid of its pid namespace's init, whether it still runs."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.namespace_pid = 0
        self.alive = True
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[None] = loop.create_future()
        self._pidfd = os.pidfd_open(process.pid)
        loop.add_reader(self._pidfd, self._on_exit, loop)

    def _on_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        _, status = os.waitpid(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self.alive = False
        if not self._exited.done():
            self._exited.set_result(None)

    async def kill_and_wait(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the keeper's process group and wait until it is reaped."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._exited), timeout_s)


async def _pipe_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader, transport


def pipe_holding(data: bytes) -> int:
    """The read end of a pipe that holds data and then ends.

    data must fit the pipe's buffer (64 KiB; 8 KiB for a user past fs.pipe-user-pages-soft): the write end is
    non-blocking, so data that does not fit raises OSError instead of blocking forever.
    """
    read_fd, write_fd = os.pipe()
    try:
        os.set_blocking(write_fd, False)
        written = os.write(write_fd, data)
        if written != len(data):
            raise OSError(f"a pipe took {written} of {len(data)} bytes")
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return read_fd


async def start_keeper(
    bwrap: str,
    options_for_fds: Callable[[int, int], list[str]],
    command: list[str],
    *,
    seccomp_program: bytes,
    env: Mapping[str, str],
    ready_line: bytes,
    timeout_s: float,
) -> Keeper:
    """Spawn the keeper; return once it printed `ready_line`, else kill it and raise SandboxStartFailedError.

    options_for_fds(info_fd, seccomp_fd) gives bwrap's options; seccomp_fd holds seccomp_program.
    """
    info_r, info_w = os.pipe()
    out_r, out_w = os.pipe()
    seccomp_r = pipe_holding(seccomp_program)
    # Options go through a pipe (bwrap --args FD), so they never show in the sandbox's view of pid 1.
    options = options_for_fds(info_w, seccomp_r)
    args_r = pipe_holding(b"".join(option.encode() + b"\0" for option in options))
    try:
        # Spawned on the event loop thread on purpose: bwrap's --die-with-parent watches the spawning thread.
        process = subprocess.Popen(  # noqa: ASYNC220
            [bwrap, "--args", str(args_r), "--", *command],
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=out_w,
            pass_fds=(info_w, args_r, seccomp_r),
            close_fds=True,
            start_new_session=True,
            env=dict(env),
        )
    except BaseException:
        os.close(info_r)
        os.close(out_r)
        raise
    finally:
        for fd in (info_w, out_w, args_r, seccomp_r):
            os.close(fd)
    keeper = Keeper(process)
    transports: list[asyncio.BaseTransport] = []
    try:
        info_reader, info_transport = await _pipe_reader(info_r)
        out_reader, out_transport = await _pipe_reader(out_r)
        transports += [info_transport, out_transport]
        async with asyncio.timeout(timeout_s):
            info = await info_reader.read()
            try:
                await out_reader.readuntil(ready_line)
            except asyncio.IncompleteReadError as exc:
                detail = exc.partial.decode(errors="replace").strip()[-MAX_ERROR_CHARS:]
                raise SandboxStartFailedError(f"bwrap could not start the sandbox: {detail or 'no output'}") from None
        keeper.namespace_pid = int(json.loads(info)["child-pid"])
    except BaseException as exc:
        await keeper.kill_and_wait()
        if isinstance(exc, TimeoutError):
            raise SandboxStartFailedError(f"the sandbox did not start within {timeout_s} s") from None
        if isinstance(exc, ValueError | KeyError):
            raise SandboxStartFailedError(f"bwrap reported no namespace pid: {exc}") from None
        raise
    finally:
        for transport in transports:
            transport.close()
    return keeper
