"""limits_hit from a real gateway (local backend) for the limits whose hits are easy to miss: the file-size
limit in each way it shows, a CPU or memory hit inside a shell that carries on, and memory and process hits
without cgroups (rlimits only). Timeout, output, the cgroup OOM kill, the pids cgroup and a CPU spin of the
exec's own process are covered by test_sandbox_escape.py; classify_limits itself by test_sandbox_outcome.py.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Gateway, SandboxClient

pytestmark = [pytest.mark.escape, pytest.mark.integration]

AssertServing = Callable[["Gateway"], None]
MAX_FILE_BYTES = 1 << 20


def test_file_size_limit_is_enforced_and_reported_however_it_shows(
    gateway: Gateway, client: SandboxClient, assert_serving: AssertServing
) -> None:
    sandbox = client.create(job_id="fsize", limits={"max_file_bytes": MAX_FILE_BYTES}).sandbox_id
    try:
        killed = client.exec(sandbox, argv=["dd", "if=/dev/zero", "of=big", "bs=64k", "count=100", "status=none"])
        assert killed.result.signal == signal.SIGXFSZ and killed.limits_hit == {"file_size"}
        assert client.exec(sandbox, argv=["stat", "-c", "%s", "big"]).text.strip() == str(MAX_FILE_BYTES)
        carried_on = client.exec(sandbox, shell="head -c 2000000 /dev/zero > big2; echo after")
        assert carried_on.result.exit_code == 0 and carried_on.text == "after\n"
        assert carried_on.limits_hit == {"file_size"}  # from the shell's "File size limit exceeded"
        efbig = client.exec(sandbox, argv=["python3", "-c", "open('big3', 'wb').write(bytes(2 << 20))"])
        assert efbig.result.exit_code == 1 and b"File too large" in efbig.stderr  # Python ignores SIGXFSZ
        assert efbig.limits_hit == {"file_size"}
        for command in ("cat /dev/zero > /tmp/big", "fallocate -l 2M big4", "truncate -s 2M big5"):
            outcome = client.exec(sandbox, shell=command)
            assert outcome.result.exit_code == 128 + signal.SIGXFSZ, command
            assert outcome.limits_hit == {"file_size"}, command
        assert client.exec(sandbox, shell="head -c 1000 /dev/zero > small").limits_hit == set()
    finally:
        client.destroy(sandbox)
    assert_serving(gateway)


def test_cpu_limit_of_a_child_is_reported_when_its_shell_carries_on(
    gateway: Gateway, client: SandboxClient, assert_serving: AssertServing
) -> None:
    sandbox = client.create(job_id="cpu", limits={"cpu_s": 1}).sandbox_id
    try:
        outcome = client.exec(sandbox, shell="sh -c 'while :; do :; done'; echo after", timeout_s=60)
        assert outcome.result.exit_code == 0 and outcome.text == "after\n"
        assert outcome.limits_hit == {"cpu"}
    finally:
        client.destroy(sandbox)
    assert_serving(gateway)


def test_memory_and_process_limits_without_cgroups_are_reported(
    start_gateway_process: Callable[..., Gateway], assert_serving: AssertServing
) -> None:
    gateway = start_gateway_process(CGROUP_MODE="off", WARM_POOL_SIZE="0")
    client = gateway.client
    limits = {"memory_bytes": 128 << 20, "max_processes": 16}
    sandbox = client.create(job_id="rlimits", limits=limits).sandbox_id
    try:
        memory = client.exec(sandbox, shell="python3 -c 'x = bytearray(400 << 20)'; echo after")
        assert memory.text == "after\n" and b"MemoryError" in memory.stderr  # RLIMIT_AS refused the allocation
        assert memory.limits_hit == {"memory"}
        forks = client.exec(sandbox, shell="for i in $(seq 40); do sleep 5 & done; wait", timeout_s=60)
        assert b"Cannot fork" in forks.stderr  # RLIMIT_NPROC refused a fork
        assert forks.limits_hit == {"processes"}
    finally:
        client.destroy(sandbox)
    assert_serving(gateway)
