"""The ranks' heartbeat watchdog and rendezvous guard (rank_health.py) on their own: each way a peer can be gone
is noticed (silent beyond peer_timeout_s, marked failed, replaced by a new process, its store gone), a peer that
left cleanly or merely beats slowly is not, and a rank restarted on its own waits out the old group's store
before joining. A fake clock drives the timeouts; a real TCPStore checks the store calls."""

from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
from torch._C._distributed_c10d import TCPStore

from miles.trainer.rank_health import (
    FORMED_KEY,
    KEY_PREFIX,
    RankWatchdog,
    connect_store,
    guard_rendezvous,
    heartbeat_interval_s,
)


class DictStore:
    """The Store protocol over a dict; `gone` makes every call fail like a TCPStore whose host died."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.gone = False

    def _alive(self) -> None:
        if self.gone:
            raise RuntimeError("Broken pipe")

    def set(self, key: str, value: str) -> None:
        self._alive()
        self.data[key] = value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._alive()
        return [self.data[key].encode() for key in keys]

    def check(self, keys: list[str]) -> bool:
        self._alive()
        return all(key in self.data for key in keys)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _pair(peer_timeout_s: float = 10.0) -> tuple[DictStore, Clock, RankWatchdog, RankWatchdog]:
    store, clock = DictStore(), Clock()
    incarnations = ["inc-0", "inc-1"]
    ranks = [RankWatchdog(store, r, 2, incarnations[r], peer_timeout_s, clock=clock) for r in range(2)]
    for watchdog in ranks:
        watchdog.formed(incarnations)
    return store, clock, ranks[0], ranks[1]


def test_beating_peers_are_fine_and_rank_0_marks_the_store_formed() -> None:
    store, clock, rank0, rank1 = _pair()
    assert store.data[FORMED_KEY] == "1"
    for _ in range(50):
        clock.now_s += 1.0
        assert rank0.check_once() is None
        assert rank1.check_once() is None
    assert store.data[f"{KEY_PREFIX}1"] == "inc-1 51"


def test_a_silent_peer_is_gone_after_peer_timeout_s_not_before() -> None:
    _, clock, rank0, rank1 = _pair(peer_timeout_s=10.0)
    assert rank1.check_once() is None
    assert rank0.check_once() is None  # sees rank 1's latest beat
    clock.now_s += 10.0  # rank 1 is killed: it beats no more
    assert rank0.check_once() is None
    clock.now_s += 0.5
    reason = rank0.check_once()
    assert reason is not None and reason.startswith("rank 1 sent no heartbeat for 10.5 s")


def test_a_failed_peer_is_gone_at_once() -> None:
    _, _, rank0, rank1 = _pair()
    rank1.stop(clean=False)
    assert rank0.check_once() == "rank 1 failed"


def test_a_peer_that_left_cleanly_is_no_longer_watched() -> None:
    _, clock, rank0, rank1 = _pair(peer_timeout_s=10.0)
    rank1.stop(clean=True)
    assert rank0.check_once() is None
    clock.now_s += 1000.0
    assert rank0.check_once() is None


def test_a_replaced_peer_is_gone_at_once() -> None:
    """A rank restarted on its own writes its new incarnation into the old group's store (guard_rendezvous)."""
    store, _, rank0, _ = _pair()
    store.set(f"{KEY_PREFIX}1", "new-incarnation 0")
    reason = rank0.check_once()
    assert reason is not None and reason.startswith("rank 1 was replaced by a new process")


def test_a_store_that_stops_answering_ends_the_rank_after_a_short_grace() -> None:
    store, clock, _, rank1 = _pair(peer_timeout_s=10.0)
    store.gone = True  # rank 0 (the store's host) died
    assert rank1.check_once() is None
    clock.now_s += 3 * heartbeat_interval_s(10.0)
    reason = rank1.check_once()
    assert reason is not None and reason.startswith("the rendezvous store stopped answering")


def test_the_thread_calls_on_lost_with_the_reason_and_stops() -> None:
    store, clock = DictStore(), Clock()
    lost: list[tuple[int, str]] = []
    done = threading.Event()

    def on_lost(rank: int, reason: str) -> None:
        lost.append((rank, reason))
        done.set()

    watchdog = RankWatchdog(store, 0, 2, "inc-0", 0.5, on_lost=on_lost, clock=clock)
    watchdog.formed(["inc-0", "inc-1"])
    store.set(f"{KEY_PREFIX}1", "inc-1 failed")
    watchdog.start()
    assert done.wait(60.0)
    assert lost == [(0, "rank 1 failed")]


def test_guard_waits_out_a_formed_store_then_joins_the_fresh_one() -> None:
    old, fresh = DictStore(), DictStore()
    old.set(FORMED_KEY, "1")
    stores = [old, fresh]
    connects: list[Any] = []

    def connect() -> DictStore:
        store = stores[len(connects)]
        connects.append(store)
        return store

    def old_rank_0_exits() -> None:  # its watchdog sees rank 1's new incarnation
        while f"{KEY_PREFIX}1" not in old.data:
            threading.Event().wait(0.01)
        old.gone = True

    waiter = threading.Thread(target=old_rank_0_exits)
    waiter.start()
    joined = guard_rendezvous(connect, 1, "new-inc", poll_s=0.01, wait_s=600.0)
    waiter.join()
    assert joined is fresh and connects == [old, fresh]
    assert old.data[f"{KEY_PREFIX}1"] == "new-inc 0"


def test_guard_gives_up_when_the_old_group_never_ends() -> None:
    old = DictStore()
    old.set(FORMED_KEY, "1")
    with pytest.raises(TimeoutError):
        guard_rendezvous(lambda: old, 1, "new-inc", poll_s=0.01, wait_s=0.05)


def test_watchdog_over_a_real_tcp_store() -> None:
    """The calls the watchdog makes work on torch's TCPStore (set, multi_get, check), and a client of a store
    whose host went away fails, which is what the watchdog reads as `store gone`."""
    # Port 0: the store binds a port nobody else holds (a free_port() can be taken by a parallel test's store in
    # between, and the two clients then talk to different servers).
    server = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    port = server.port
    client0, client1 = connect_store("127.0.0.1", port, 30.0), connect_store("127.0.0.1", port, 30.0)
    clock = Clock()
    rank0 = RankWatchdog(client0, 0, 2, "inc-0", 10.0, clock=clock)
    rank1 = RankWatchdog(client1, 1, 2, "inc-1", 10.0, clock=clock)
    rank0.formed(["inc-0", "inc-1"])
    rank1.formed(["inc-0", "inc-1"])
    # TCPStore's set does not wait for the server: a get on the same connection is answered after it is applied
    # (client1's check alone raced rank 0's set on a loaded CI machine).
    assert client0.get(FORMED_KEY) == b"1"
    assert client1.check([FORMED_KEY])
    assert rank0.check_once() is None and rank1.check_once() is None
    del server
    clock.now_s += 1.0
    rank1.check_once()
    clock.now_s += 3 * heartbeat_interval_s(10.0)
    reason = rank1.check_once()
    assert reason is not None and reason.startswith("the rendezvous store stopped answering")


def test_a_collective_failing_on_a_closed_connection_ends_the_rank_at_once() -> None:
    """gloo's error when the other end of a pair closed its socket: that peer's process ended."""
    store, clock = DictStore(), Clock()
    lost: list[tuple[int, str]] = []
    watchdog = RankWatchdog(store, 0, 2, "inc-0", 3600.0, on_lost=lambda r, why: lost.append((r, why)), clock=clock)
    watchdog.formed(["inc-0", "inc-1"])
    error = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\nmore")
    watchdog.await_verdict(error)
    assert lost == [
        (
            0,
            "a collective failed because a peer's process ended "
            "([/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer)",
        )
    ]


def test_only_collective_errors_wait_for_the_watchdogs_verdict() -> None:
    """A failing collective asks the watchdog whether a peer is gone (it exits the process if so); an error of the
    step itself (out of memory, a bug) propagates at once."""
    from miles.common.jobspec.trainer import TrainConfig
    from miles.trainer.distributed import RankRunner

    class Backend:
        def data_ranks(self, rank: int, world_size: int) -> Any:
            return None

    asked: list[str] = []

    class Watchdog:
        def await_verdict(self, error: BaseException) -> None:
            asked.append(str(error))

    runner = RankRunner(Backend(), TrainConfig(), rank=1, world_size=2)  # type: ignore[arg-type]
    runner.watchdog = Watchdog()  # type: ignore[assignment]

    def fail(message: str) -> None:
        raise RuntimeError(message)

    for message in ("[gloo/transport/tcp/pair.cc:534] Read error", "NCCL error: remote process exited", "oom"):
        with pytest.raises(RuntimeError, match=message[:10].replace("[", r"\[")):
            runner.call(fail, message)
    assert asked == ["[gloo/transport/tcp/pair.cc:534] Read error", "NCCL error: remote process exited"]
