"""The local backend: a bubblewrap sandbox per sandbox id on this machine (see bwrap.py for the commands and
backend.py at the package root for what it does not protect against).

Per sandbox it holds: a work dir under state_dir (mode 0700, owned by the sandbox's uid), a uid of its own
(setuid mode), memory/pids cgroups (where usable), and the keeper process. Destroy kills the keeper (which
tears down the pid namespace and with it every process of the sandbox), then everything left in its cgroups
and, in setuid mode, every process still running under its uid; only then are its files and uid released.
Start-up checks the host tools, removes work dirs a crashed gateway left in state_dir (so state_dir must not be
shared by two gateways), and runs one sandbox end to end, so that a host that cannot sandbox refuses to start
instead of failing per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import tempfile
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path

from miles.common.errors import MilesError
from miles.sandbox.errors import BackendUnusableError, SandboxGoneError, SandboxNotFoundError, SandboxStartFailedError
from miles.sandbox.local import files
from miles.sandbox.local.bwrap import (
    CHAIN_ENV,
    KEEPER_COMMAND,
    READY_LINE,
    HostTools,
    enter_spec,
    exec_argv,
    exec_limits,
    find_host_tools,
    keeper_options,
)
from miles.sandbox.local.cgroups import CgroupCounters, CgroupManager, SandboxCgroup
from miles.sandbox.local.keeper import Keeper, pipe_holding, start_keeper
from miles.sandbox.local.processes import stream_process
from miles.sandbox.local.seccomp import build_filter
from miles.sandbox.local.uids import UidPool, kill_uid_processes
from miles.sandbox.models import ExecEvent, ExecResult, ExecSpec, FileContent, OutputChunk, SandboxSpec
from miles.sandbox.outcome import ProcessOutcome, classify_limits
from miles.sandbox.settings import SandboxSettings

log = logging.getLogger(__name__)

_PREFLIGHT_ID = "preflight"
_SANDBOX_DIR_NAME = re.compile(r"[0-9a-f]{16}|preflight")


@dataclass
class _LocalSandbox:
    sandbox_id: str
    spec: SandboxSpec
    directory: Path
    work_dir: Path
    uid: int | None
    cgroup: SandboxCgroup | None
    keeper: Keeper | None = None
    destroyed: bool = False


class LocalBackend:
    """Sandboxes as bubblewrap process trees on this host."""

    name = "local"
    supports_egress_allowlist = False

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self.tools: HostTools | None = None
        self.userns = False
        self.uids: UidPool | None = None
        self.cgroups = CgroupManager({})
        self.state_dir = Path(settings.state_dir) if settings.state_dir else None
        self._owns_state_dir = False
        self._sandboxes: dict[str, _LocalSandbox] = {}
        self.seccomp_program = build_filter()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.tools = find_host_tools(self.settings.bwrap_path)
        mode = self.settings.privilege_mode
        if mode == "auto":
            mode = "setuid" if os.geteuid() == 0 else "userns"
        if mode == "setuid" and os.geteuid() != 0:
            message = "privilege_mode 'setuid' needs the gateway to run as root"
            raise BackendUnusableError(message, field="privilege_mode")
        self.userns = mode == "userns"
        if not self.userns:
            self.uids = UidPool(self.settings.uid_range_start, self.settings.uid_range_size)
        if self.state_dir is None:
            self.state_dir = Path(tempfile.mkdtemp(prefix="miles-sandbox-"))
            self._owns_state_dir = True
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.chmod(0o700)
        await asyncio.to_thread(self._remove_stale_work_dirs)
        if self.settings.cgroup_mode != "off":
            self.cgroups = CgroupManager.detect()
        if self.settings.cgroup_mode == "require" and not self.cgroups.has_memory:
            raise BackendUnusableError("cgroup_mode 'require': no usable memory cgroup here", field="cgroup_mode")
        if self.userns and not self.tools.bwrap_disables_userns:
            log.warning(
                "bwrap has no --disable-userns (bubblewrap before 0.8.0): only the seccomp filter keeps sandboxes "
                "from creating user namespaces; install bubblewrap 0.8.0 or later for the second barrier",
                extra={"bwrap": self.tools.bwrap},
            )
        await self._preflight()
        log.info(
            "local sandbox backend ready",
            extra={
                "privilege_mode": mode,
                "cgroup_controllers": sorted(self.cgroups.controllers),
                "state_dir": str(self.state_dir),
                "seccomp_filter_instructions": len(self.seccomp_program) // 8,
                "disable_userns": self.userns and self.tools.bwrap_disables_userns,
            },
        )

    def _remove_stale_work_dirs(self) -> None:
        """Work dirs left by a gateway that died with this state_dir (its sandboxes died with it)."""
        assert self.state_dir is not None
        for entry in self.state_dir.iterdir():
            if _SANDBOX_DIR_NAME.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
                log.info("removing a stale sandbox work dir", extra={"path": str(entry)})
                shutil.rmtree(entry, ignore_errors=True)

    async def _preflight(self) -> None:
        """Start one sandbox and run `true` in it: proves bwrap, namespaces and the exec chain work here."""
        from miles.sandbox.models import Limits, NetworkSpec

        template = self.settings.templates[self.settings.default_template]
        defaults = template.limits
        limits = Limits(**defaults.model_dump())
        spec = SandboxSpec(self.settings.default_template, template, limits, NetworkSpec(), self.settings.workdir)
        try:
            await self.create(_PREFLIGHT_ID, spec)
            exec_spec = ExecSpec(("true",), b"", self.settings.startup_timeout_s, spec.workdir, template.env, limits)
            result = [event async for event in self.exec(_PREFLIGHT_ID, exec_spec)][-1]
        except MilesError as exc:
            raise BackendUnusableError(self._preflight_hint(exc.message)) from None
        finally:
            await self.destroy(_PREFLIGHT_ID)
        if not isinstance(result, ExecResult) or result.exit_code != 0:
            raise BackendUnusableError(self._preflight_hint(f"`true` inside a sandbox ended with {result}"))

    def _preflight_hint(self, detail: str) -> str:
        hint = (
            " In a container the unprivileged (userns) mode needs user namespaces: allow unshare(CLONE_NEWUSER) in "
            "the container's seccomp/AppArmor profile, or run the Kubernetes backend (the production choice)."
            if self.userns
            else ""
        )
        return f"the local sandbox backend cannot start a sandbox on this host: {detail}.{hint}"

    async def close(self) -> None:
        for sandbox_id in list(self._sandboxes):
            await self.destroy(sandbox_id)
        await asyncio.to_thread(self.cgroups.close)
        if self._owns_state_dir and self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # -- sandboxes ---------------------------------------------------------------------------------------------

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> None:
        assert self.tools is not None and self.state_dir is not None, "start() first"
        uid = self.uids.take() if self.uids is not None else None
        directory = self.state_dir / sandbox_id
        sandbox = _LocalSandbox(sandbox_id, spec, directory, directory / "work", uid, cgroup=None)
        self._sandboxes[sandbox_id] = sandbox
        try:
            directory.mkdir(mode=0o700)
            sandbox.work_dir.mkdir(mode=0o700)
            if uid is not None:
                os.chown(sandbox.work_dir, uid, uid)
            if self.cgroups.controllers:
                sandbox.cgroup = self.cgroups.create(sandbox_id)
                self._apply_cgroup_limits(sandbox)
            options = functools.partial(
                keeper_options,
                spec=spec,
                work_dir=sandbox.work_dir,
                userns=self.userns,
                disable_userns=self.userns and self.tools.bwrap_disables_userns,
            )
            sandbox.keeper = await start_keeper(
                self.tools.bwrap,
                lambda info_fd, seccomp_fd: options(info_fd=info_fd, seccomp_fd=seccomp_fd),
                KEEPER_COMMAND,
                seccomp_program=self.seccomp_program,
                env=CHAIN_ENV,
                ready_line=READY_LINE,
                timeout_s=self.settings.startup_timeout_s,
            )
        except BaseException as exc:
            await self.destroy(sandbox_id)
            if isinstance(exc, MilesError | asyncio.CancelledError):
                raise
            if isinstance(exc, OSError):
                raise SandboxStartFailedError(f"could not start a local sandbox: {exc}") from exc
            raise

    def _apply_cgroup_limits(self, sandbox: _LocalSandbox) -> None:
        assert sandbox.cgroup is not None
        try:
            sandbox.cgroup.set_memory_limit(sandbox.spec.limits.memory_bytes)
            # Only the exec's own processes join the cgroups (enter.py's waiting parent stays outside).
            sandbox.cgroup.set_pids_limit(sandbox.spec.limits.max_processes)
        except OSError as exc:
            raise SandboxStartFailedError(f"could not set the sandbox's cgroup limits: {exc}") from exc

    async def adopt(self, sandbox_id: str, spec: SandboxSpec) -> bool:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None or not self.is_alive(sandbox_id) or sandbox.spec.template != spec.template:
            return False
        if spec.workdir != sandbox.spec.workdir or spec.network != sandbox.spec.network:
            return False
        sandbox.spec = spec
        if sandbox.cgroup is not None:
            self._apply_cgroup_limits(sandbox)
        return True

    def is_alive(self, sandbox_id: str) -> bool:
        sandbox = self._sandboxes.get(sandbox_id)
        return sandbox is not None and not sandbox.destroyed and sandbox.keeper is not None and sandbox.keeper.alive

    def _live(self, sandbox_id: str) -> _LocalSandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r}", field="sandbox_id")
        if not self.is_alive(sandbox_id):
            raise SandboxGoneError(f"sandbox {sandbox_id!r} is no longer running; destroy it", field="sandbox_id")
        return sandbox

    async def exec(self, sandbox_id: str, spec: ExecSpec) -> AsyncGenerator[ExecEvent, None]:
        sandbox = self._live(sandbox_id)
        assert self.tools is not None and sandbox.keeper is not None
        cgroup = sandbox.cgroup
        rlimits = exec_limits(
            spec,
            memory_cgroup=cgroup is not None and cgroup.has_memory,
            pids_cgroup=cgroup is not None and cgroup.has_pids,
            address_space_factor=self.settings.address_space_factor,
        )
        entering = enter_spec(
            keeper_pid=sandbox.keeper.namespace_pid,
            rlimits=rlimits,
            userns=self.userns,
            cgroup_procs_files=cgroup.procs_files if cgroup is not None else (),
            seccomp_program=self.seccomp_program,
        )
        before = cgroup.counters() if cgroup is not None else CgroupCounters()
        outcome: ProcessOutcome | None = None
        spec_fd = pipe_holding(entering.encode())
        try:
            process_events = stream_process(
                exec_argv(self.tools, spec_fd=spec_fd, spec=spec, uid=sandbox.uid),
                env=CHAIN_ENV,
                stdin=spec.stdin,
                timeout_s=spec.timeout_s,
                max_output_bytes=spec.limits.max_output_bytes,
                pass_fds=(spec_fd,),
            )
            async with contextlib.aclosing(process_events):
                async for item in process_events:
                    if isinstance(item, OutputChunk):
                        yield item
                    else:
                        outcome = item
        finally:
            os.close(spec_fd)
        assert outcome is not None
        after = cgroup.counters() if cgroup is not None else CgroupCounters()
        yield ExecResult(
            exit_code=outcome.exit_code,
            signal=outcome.signal,
            wall_s=outcome.wall_s,
            cpu_s=outcome.cpu_s,
            limits_hit=classify_limits(
                outcome,
                spec.limits,
                oom_killed=after.oom_kills > before.oom_kills,
                fork_refused=after.pids_limit_hits > before.pids_limit_hits,
            ),
            stdout_bytes=outcome.stdout_bytes,
            stderr_bytes=outcome.stderr_bytes,
        )

    def _owner(self, sandbox: _LocalSandbox) -> tuple[int, int] | None:
        return (sandbox.uid, sandbox.uid) if sandbox.uid is not None else None

    async def write_file(self, sandbox_id: str, parts: tuple[str, ...], data: bytes, mode: int) -> int:
        sandbox = self._live(sandbox_id)
        return await asyncio.to_thread(files.write_file, sandbox.work_dir, parts, data, mode, self._owner(sandbox))

    async def read_file(self, sandbox_id: str, parts: tuple[str, ...], max_bytes: int) -> FileContent:
        sandbox = self._live(sandbox_id)
        return await asyncio.to_thread(files.read_file, sandbox.work_dir, parts, max_bytes)

    async def destroy(self, sandbox_id: str) -> None:
        sandbox = self._sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return
        sandbox.destroyed = True
        if sandbox.keeper is not None:
            # Killing the pid namespace's init makes the kernel kill every process in the namespace.
            with contextlib.suppress(ProcessLookupError):
                os.kill(sandbox.keeper.namespace_pid, signal.SIGKILL)
            await sandbox.keeper.kill_and_wait()
        if sandbox.cgroup is not None:
            await asyncio.to_thread(sandbox.cgroup.kill_all)
        released = True
        if sandbox.uid is not None:
            released = await asyncio.to_thread(kill_uid_processes, sandbox.uid)
        if sandbox.cgroup is not None and not await asyncio.to_thread(sandbox.cgroup.remove):
            log.warning("sandbox cgroup not removed", extra={"sandbox_id": sandbox_id})
        await asyncio.to_thread(shutil.rmtree, sandbox.directory, True)
        if sandbox.uid is not None and self.uids is not None:
            if released:
                self.uids.release(sandbox.uid)
            else:
                log.error("sandbox uid still has processes; not reused", extra={"uid": sandbox.uid})
