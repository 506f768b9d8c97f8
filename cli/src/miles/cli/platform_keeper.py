"""The platform keeper: restarts a dead shared service of `miles up`, on its ports, with backoff.

`miles up` starts it detached (`python -m miles.cli.platform_keeper --home <home>`) once every service is
ready. Every `poll_interval_s` it checks each service's pid (and that the pid still runs the service's program);
a dead one is started again from `<home>/run/services.json`, with the argv and environment it was first started
with: same ports, same tokens, same data directories (Redis replays its AOF). Per-job processes keep their
addresses, so jobs ride through the restart (the controller supervises those; this supervises the services).

Backoff: a service that dies again within `stable_after_s` of a restart waits `initial_backoff_s`, doubling up to
`max_backoff_s`, before the next attempt; one that stayed up that long starts from zero again. Each restart is
counted in platform.json (`restarts`, shown by `miles status`) and logged to `<home>/logs/keeper.log`.

It exits when platform.json is gone or names another keeper (`miles down` stops it before the services).
Limits: nothing restarts the keeper itself except the next `miles up`; one machine; a port taken by another
program while its service was down keeps that service down (logged, retried with backoff).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from miles.cli.platform_state import (
    SERVICE_ORDER,
    Layout,
    PlatformState,
    is_ready,
    load_specs,
    load_state,
    pid_alive,
    save_state,
    spawn_service,
)
from miles.common.logs import configure_logging
from miles.common.spawn import ProcessSpec, signal_process, spawn

log = logging.getLogger(__name__)

KEEPER_PROGRAM = "miles.cli.platform_keeper"
"""What the keeper's command line names (`python -m <this>`), checked before it is signalled."""


@dataclass
class _Backoff:
    failures: int = 0
    next_attempt_s: float = 0.0
    started_s: float = 0.0


class PlatformKeeper:
    def __init__(
        self,
        layout: Layout,
        *,
        poll_interval_s: float = 1.0,
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stable_after_s: float = 60.0,
    ) -> None:
        self.layout = layout
        self.poll_interval_s = poll_interval_s
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_after_s = stable_after_s
        self._backoff: dict[str, _Backoff] = {}
        self._children: list[subprocess.Popen[bytes]] = []

    def run(self) -> None:
        """Check and restart until the platform is stopped (or another keeper took over)."""
        while True:
            state = load_state(self.layout)
            if state is None or state.keeper_pid not in (0, os.getpid()):
                log.info("platform stopped or taken over; keeper exits")
                return
            self.check_once(state)
            time.sleep(self.poll_interval_s)

    def check_once(self, state: PlatformState, *, ignore_backoff: bool = False) -> list[str]:
        """Restart every dead service (in start order) whose backoff allows it; returns their names."""
        self._children = [child for child in self._children if child.poll() is None]  # reap
        specs, threads = load_specs(self.layout)
        now_s = time.monotonic()
        restarted: list[str] = []
        for name in SERVICE_ORDER:
            record = state.services.get(name)
            spec = specs.get(name)
            if record is None or spec is None:
                continue
            backoff = self._backoff.setdefault(name, _Backoff(started_s=now_s))
            if pid_alive(record.pid, record.program):
                if backoff.failures and now_s - backoff.started_s >= self.stable_after_s:
                    backoff.failures = 0
                continue
            if not ignore_backoff and now_s < backoff.next_attempt_s:
                continue
            new_record, process = spawn_service(self.layout, spec, threads)
            new_record.restarts = record.restarts + 1
            state.services[name] = new_record
            save_state(self.layout, state)
            self._children.append(process)
            backoff.failures += 1
            backoff.started_s = now_s
            delay_s = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (backoff.failures - 1))
            backoff.next_attempt_s = now_s + delay_s
            restarted.append(name)
            log.warning(
                "restarted a dead shared service",
                extra={"service": name, "pid": new_record.pid, "restarts": new_record.restarts, "url": spec.url},
            )
        return restarted


def start_keeper(layout: Layout) -> int:
    """Start the keeper detached (its own session, it outlives `miles up`); returns its pid."""
    argv = (sys.executable, "-m", KEEPER_PROGRAM, "--home", str(layout.home.resolve()))
    return spawn(ProcessSpec(argv, layout.log_file("keeper"))).pid


def stop_keeper(state: PlatformState, *, grace_s: float = 5.0) -> None:
    """Stop the keeper first, so that it does not restart services that are being stopped."""
    pid = state.keeper_pid
    if not pid or not pid_alive(pid, KEEPER_PROGRAM):
        return
    signal_process(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pid_alive(pid, KEEPER_PROGRAM) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid, KEEPER_PROGRAM):
        signal_process(pid, signal.SIGKILL)


def keeper_alive(state: PlatformState) -> bool:
    return bool(state.keeper_pid) and pid_alive(state.keeper_pid, KEEPER_PROGRAM)


def heal_platform(layout: Layout, state: PlatformState, *, ready_timeout_s: float) -> list[str]:
    """`miles up` on a running platform: restart what is dead on its own ports (the keeper does it if it runs,
    else this does and then starts a keeper), and wait until every service is ready. Never moves a port.
    Returns the services restarted here. Raises TimeoutError when one is still not ready after the timeout."""
    restarted: list[str] = []
    deadline = time.monotonic() + ready_timeout_s
    while True:
        current = load_state(layout) or state
        # Looked at on every pass: a keeper killed just before `up` can still look alive on the first one (its
        # /proc entry outlives the signal for a moment), and one that dies while we wait must not leave us waiting.
        if not keeper_alive(current):
            restarted += PlatformKeeper(layout).check_once(current, ignore_backoff=True)
            current.keeper_pid = start_keeper(layout)
            save_state(layout, current)
        not_ready = [name for name, record in current.services.items() if not is_ready(record)]
        if not not_ready:
            return restarted
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {ready_timeout_s:.0f}s: {', '.join(not_ready)}")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", required=True, type=Path)
    parser.add_argument("--poll-interval-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    configure_logging("platform-keeper")
    PlatformKeeper(Layout(args.home), poll_interval_s=args.poll_interval_s).run()


if __name__ == "__main__":
    main()
