"""Liveness of the trainer's ranks: a heartbeat through the rendezvous store, a watchdog that ends the process when
a peer is gone, and a rendezvous guard that never joins a group formed before this process started.

Why: ranks > 0 legitimately wait a long time for rank 0 (which waits for data), so the operation channel has a
7-day timeout (`distributed.py`). A rank that dies must not leave its peers blocked for that long: NCCL never
notices a dead peer by itself, and gloo notices a closed socket but not a host that vanished.

- Every rank runs `RankWatchdog`, a daemon thread that every `interval_s` writes `miles/rank/<r>` =
  "<incarnation> <counter>" into the torch.distributed store (rank 0's TCPStore, or torchrun's agent store) and
  reads every rank's entry in one `multi_get`. A peer whose counter has not moved for `peer_timeout_s`, whose entry
  says `failed` (it is exiting on an error), or whose incarnation changed (its process was replaced by a new one),
  or a store that stops answering (its host, rank 0 or torchrun's agent, is gone; TCPStore clients never
  reconnect) makes the rank log one line and exit with `PEER_LOST_EXIT_CODE` (75, EX_TEMPFAIL) at once:
  `os._exit`, because the compute thread may be stuck inside a collective. Nothing is checkpointed; the restart
  resumes from the last durable checkpoint and the buffer redelivers what was not acked (consumption.py).
- A clean stop writes `left`: peers stop watching that rank (ranks > 0 leave after rank 0's stop operation).
- `guard_rendezvous` (ranks > 0, before joining): a store whose `miles/formed` key is set belongs to a group that
  formed before this process started (on Kubernetes a rank's pod restarted while rank 0 still runs). The rank
  announces its new incarnation there (rank 0's watchdog then exits at once), waits until that store stops
  answering, and only then joins, so every rank of a group is from the same generation.

Limits: a rank whose process is alive but whose Python threads are all starved (the GIL held for more than
`peer_timeout_s`) is taken as gone. A peer alive but stuck (a deadlock in its compute thread) keeps beating: the
bounded timeout of the step's collectives (`collective_timeout_s`) is what ends that.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

log = logging.getLogger(__name__)

PEER_LOST_EXIT_CODE = 75
"""Exit status of a rank that ends because a peer is gone (EX_TEMPFAIL: restart it, it resumes)."""
# torchrun's agent reuses its store when it restarts workers itself (--max-restarts): a namespace per attempt.
_NAMESPACE = f"miles/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
KEY_PREFIX = _NAMESPACE + "rank/"
FORMED_KEY = _NAMESPACE + "formed"
LEFT = "left"
FAILED = "failed"
_STORE_FAILURE_GRACE_TICKS = 3
# What gloo says when the other end of a pair closed its socket: that process ended (or tore its group down).
_PEER_CLOSED_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class Store(Protocol):
    """What the watchdog uses of a torch.distributed Store (a TCPStore in production, a dict in unit tests)."""

    def set(self, key: str, value: str) -> None: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def check(self, keys: list[str]) -> bool: ...


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]


def heartbeat_interval_s(peer_timeout_s: float) -> float:
    """A tenth of the timeout, at most 1 s: a replaced peer or a dead store is noticed within about a second."""
    return min(1.0, peer_timeout_s / 10)


def exit_peer_lost(rank: int, reason: str) -> NoReturn:
    """The one log line, flushed, then exit without cleanup (threads may be blocked in collectives)."""
    log.error(
        "trainer rank %d: %s; exiting (status %d) so that every rank restarts from the last checkpoint",
        rank,
        reason,
        PEER_LOST_EXIT_CODE,
        extra={"rank": rank, "reason": reason, "exit_code": PEER_LOST_EXIT_CODE},
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(PEER_LOST_EXIT_CODE)


@dataclass
class _PeerView:
    counter: str = ""
    changed_at_s: float = 0.0
    left: bool = False


@dataclass
class RankWatchdog:
    """Heartbeat and peer checks of one rank; `check_once` is one tick (tests call it directly)."""

    store: Store
    rank: int
    world_size: int
    incarnation: str
    peer_timeout_s: float
    on_lost: Callable[[int, str], object] = exit_peer_lost
    clock: Callable[[], float] = time.monotonic
    peers: dict[int, str] = field(default_factory=dict)
    """rank -> incarnation of the group this rank formed with (set by `formed`)."""

    def __post_init__(self) -> None:
        self._counter = 0
        self._views: dict[int, _PeerView] = {}
        self._store_failing_since_s: float | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def formed(self, incarnations: list[str]) -> None:
        """The group formed with these incarnations (index = rank); rank 0 marks the store as taken."""
        now = self.clock()
        self.peers = {r: inc for r, inc in enumerate(incarnations) if r != self.rank}
        self._views = {r: _PeerView(changed_at_s=now) for r in self.peers}
        self.beat()
        if self.rank == 0:
            self.store.set(FORMED_KEY, "1")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"rank-watchdog-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self, *, clean: bool) -> None:
        """Stop watching. `clean`: this rank leaves on purpose (peers stop watching it); otherwise it is failing and
        peers exit at once instead of waiting out the timeout. Best effort: the store may be gone already."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)  # first: a beat in flight would overwrite the mark
        with contextlib.suppress(Exception):  # the store's host left first: nothing to tell anyone
            self.store.set(self._key(self.rank), f"{self.incarnation} {LEFT if clean else FAILED}")

    def await_verdict(self, error: BaseException) -> None:
        """After a collective failed: a connection the peer closed (gloo: its process ended) ends this rank at once;
        otherwise give the watchdog the time it needs to tell whether a peer is gone (it then exits the process with
        its one line). Returning means every peer still beats: the error is another one."""
        message = str(error)
        if any(sign in message for sign in _PEER_CLOSED_SIGNS):
            first_line = message.strip().splitlines()[0] if message.strip() else type(error).__name__
            self.on_lost(self.rank, f"a collective failed because a peer's process ended ({first_line})")
            return
        interval_s = heartbeat_interval_s(self.peer_timeout_s)
        log.warning(
            "a collective failed: waiting for the peers' heartbeats to tell whether a rank is gone",
            extra={"rank": self.rank, "wait_s": self.peer_timeout_s + (_STORE_FAILURE_GRACE_TICKS + 2) * interval_s},
        )
        self._stopping.wait(self.peer_timeout_s + (_STORE_FAILURE_GRACE_TICKS + 2) * interval_s)

    # ---- one tick ------------------------------------------------------------------------------------------

    def beat(self) -> None:
        self._counter += 1
        self.store.set(self._key(self.rank), f"{self.incarnation} {self._counter}")

    def check_once(self) -> str | None:
        """Beat, then read every peer: the reason a peer is taken as gone, or None."""
        now = self.clock()
        try:
            self.beat()
            entries = self.store.multi_get([self._key(r) for r in self.peers])
        except Exception as exc:  # any store failure means its host is unreachable
            return self._store_failed(now, exc)
        self._store_failing_since_s = None
        for (peer, expected), raw in zip(self.peers.items(), entries, strict=True):
            reason = self._peer_reason(peer, expected, raw.decode(errors="replace"), now)
            if reason is not None:
                return reason
        return None

    def _peer_reason(self, peer: int, expected: str, entry: str, now: float) -> str | None:
        view = self._views[peer]
        if view.left:
            return None
        incarnation, _, counter = entry.partition(" ")
        if incarnation != expected:
            return f"rank {peer} was replaced by a new process (incarnation {incarnation} instead of {expected})"
        if counter == FAILED:
            return f"rank {peer} failed"
        if counter == LEFT:
            view.left = True
            return None
        if counter != view.counter:
            view.counter, view.changed_at_s = counter, now
            return None
        silent_s = now - view.changed_at_s
        if silent_s > self.peer_timeout_s:
            return f"rank {peer} sent no heartbeat for {silent_s:.1f} s (peer_timeout_s {self.peer_timeout_s:g})"
        return None

    def _store_failed(self, now: float, exc: Exception) -> str | None:
        if self._store_failing_since_s is None:
            self._store_failing_since_s = now
        grace_s = _STORE_FAILURE_GRACE_TICKS * heartbeat_interval_s(self.peer_timeout_s)
        if now - self._store_failing_since_s < grace_s:
            return None
        return f"the rendezvous store stopped answering (its host, rank 0 or torchrun's agent, is gone): {exc}"

    def _run(self) -> None:
        interval_s = heartbeat_interval_s(self.peer_timeout_s)
        while not self._stopping.wait(interval_s):
            reason = self.check_once()
            if reason is not None and not self._stopping.is_set():
                self.on_lost(self.rank, reason)
                return

    @staticmethod
    def _key(rank: int) -> str:
        return f"{KEY_PREFIX}{rank}"


def connect_store(master_addr: str, master_port: int, timeout_s: float) -> Store:
    """A client of the rendezvous store (rank 0's TCPStore or torchrun's agent's), its own connection."""
    from torch._C._distributed_c10d import TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store: Store = TCPStore(master_addr, master_port, None, False, timeout, wait_for_workers=False)
    return store


def guard_rendezvous(
    connect: Callable[[], Store], rank: int, incarnation: str, *, poll_s: float = 1.0, wait_s: float
) -> Store:
    """Ranks > 0, before joining: a store of a group formed before this process started is announced to (its rank
    0 exits) and waited out; returns a client of a store no group has formed on yet. Raises TimeoutError after
    `wait_s` (the process exits non-zero and is restarted)."""
    deadline = time.monotonic() + wait_s
    store = connect()
    while store.check([FORMED_KEY]):
        log.warning(
            "the rendezvous store belongs to a group formed before this rank started: waiting for it to end",
            extra={"rank": rank},
        )
        store.set(f"{KEY_PREFIX}{rank}", f"{incarnation} 0")
        _wait_until_gone(store, deadline, poll_s)
        store = connect()
    return store


def _wait_until_gone(store: Store, deadline: float, poll_s: float) -> None:
    while time.monotonic() < deadline:
        try:
            store.check([FORMED_KEY])
        except Exception:  # the old group's store went away: what we wait for
            return
        time.sleep(poll_s)
    raise TimeoutError("the rendezvous store of an earlier group did not go away")
