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


async def start_keeper(
    bwrap: str,
    options_for_info_fd: Callable[[int], list[str]],
    command: list[str],
    *,
    env: Mapping[str, str],
    ready_line: bytes,
    timeout_s: float,
) -> Keeper:
    """Spawn the keeper; return once it printed `ready_line`, else kill it and raise SandboxStartFailedError."""
    info_r, info_w = os.pipe()
    out_r, out_w = os.pipe()
    args_r, args_w = os.pipe()
    options = options_for_info_fd(info_w)
    # Options go through a pipe (bwrap --args FD), so they never show in the sandbox's view of pid 1.
    os.write(args_w, b"".join(option.encode() + b"\0" for option in options))
    os.close(args_w)
    try:
        # Spawned on the event loop thread on purpose: bwrap's --die-with-parent watches the spawning thread.
        process = subprocess.Popen(  # noqa: ASYNC220
            [bwrap, "--args", str(args_r), "--", *command],
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=out_w,
            pass_fds=(info_w, args_r),
            close_fds=True,
            start_new_session=True,
            env=dict(env),
        )
    except BaseException:
        os.close(info_r)
        os.close(out_r)
        raise
    finally:
        os.close(info_w)
        os.close(out_w)
        os.close(args_r)
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
