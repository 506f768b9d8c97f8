"""free_port: ports below the kernel's ephemeral range, bindable, never handed out twice by one process nor, within
the reservation time, by two processes of the machine."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.common import ports
from miles.common.ports import LOWEST_PORT, ephemeral_range_start, free_port, reserve


def test_ports_come_from_below_the_ephemeral_range_and_can_be_bound() -> None:
    start = ephemeral_range_start()
    if start is None or start - LOWEST_PORT < ports.MIN_RANGE_SIZE:
        pytest.skip("this machine's ephemeral range leaves no room below it: free_port lets the OS pick")
    for _ in range(20):
        port = free_port()
        assert LOWEST_PORT <= port < start
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_one_process_never_hands_out_the_same_port_twice_even_with_the_global_random_seeded() -> None:
    picked = []
    for _ in range(200):
        random.seed(0)  # a test seeding the global generator must not make workers pick alike
        picked.append(free_port())
    assert len(set(picked)) == len(picked)


def test_a_port_in_use_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST_PORT", taken)
        monkeypatch.setattr(ports, "ephemeral_range_start", lambda: taken + ports.MIN_RANGE_SIZE)
        candidates = iter([taken, *range(taken + 1, taken + ports.MAX_ATTEMPTS)])
        monkeypatch.setattr(ports._RANDOM, "randrange", lambda low, high: next(candidates))
        assert free_port() > taken


def test_an_unreadable_or_too_low_ephemeral_range_falls_back_to_the_os(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ephemeral_range_start(tmp_path / "missing") is None
    (tmp_path / "range").write_text("1024\t65535\n")
    assert ephemeral_range_start(tmp_path / "range") == 1024
    monkeypatch.setattr(ports, "ephemeral_range_start", lambda: 1024)
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.integration
def test_a_port_another_process_handed_out_is_skipped_until_its_reservation_expires(tmp_path: Path) -> None:
    code = "import sys; from pathlib import Path; from miles.common.ports import reserve; "
    code += "print(reserve(int(sys.argv[1]), Path(sys.argv[2])))"
    other = subprocess.run([sys.executable, "-c", code, "23456", str(tmp_path)], capture_output=True, text=True)
    assert other.stdout.strip() == "True", other.stderr
    assert not reserve(23456, tmp_path)  # handed out by the other process a moment ago
    assert reserve(23457, tmp_path)
    old = time.time() - ports.RESERVATION_S - 1
    os.utime(tmp_path / "23456", (old, old))
    assert reserve(23456, tmp_path)  # expired: its process had its time to bind it
    assert not reserve(23456, tmp_path)


def test_free_port_skips_a_port_reserved_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    start = ephemeral_range_start()
    if start is None or start - LOWEST_PORT < ports.MIN_RANGE_SIZE:
        pytest.skip("this machine's ephemeral range leaves no room below it: free_port lets the OS pick")
    monkeypatch.setattr(ports, "reservation_dir", lambda: tmp_path)
    # The first port free_port would take on its own: bindable and not handed out by this process.
    wanted = next(
        p for p in range(LOWEST_PORT, start) if p not in ports._handed_out and ports._bindable("127.0.0.1", p)
    )
    candidates = iter(range(wanted, start))
    monkeypatch.setattr(ports._RANDOM, "randrange", lambda low, high: next(candidates))
    assert reserve(wanted, tmp_path)
    assert free_port() > wanted


def test_an_unwritable_reservation_directory_leaves_the_per_process_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert reserve(23458, blocker / "sub")
