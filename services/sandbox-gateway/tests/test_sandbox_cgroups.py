"""Cgroup discovery and per-sandbox control files, for cgroup v1 (this CI machine) and v2 (pure unified
hierarchy), on fake /proc and cgroupfs trees; plus one check against the real host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles.sandbox.local.cgroups import CgroupManager, Controller, own_cgroup_dirs

V1_MOUNTINFO = """\
30 25 0:26 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw,mode=755
35 30 0:31 / {root}/memory rw,relatime - cgroup cgroup rw,memory
36 30 0:32 / {root}/pids rw,relatime - cgroup cgroup rw,pids
37 30 0:33 / {root}/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTINFO = "31 25 0:27 / {root} rw,nosuid,nodev shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"


def _fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo.format(root=tmp_path / "cg"))
    return proc


def test_v1_hierarchies_are_found_per_controller(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, "8:pids:/\n4:memory:/jobs/me\n0::/\n", V1_MOUNTINFO)
    assert own_cgroup_dirs(proc) == {
        "memory": (1, tmp_path / "cg" / "memory" / "jobs" / "me"),
        "pids": (1, tmp_path / "cg" / "pids"),
    }


def test_v2_controllers_come_from_cgroup_controllers(tmp_path: Path) -> None:
    own = tmp_path / "cg" / "system.slice" / "gw.service"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpu memory pids io\n")
    proc = _fake_proc(tmp_path, "0::/system.slice/gw.service\n", V2_MOUNTINFO)
    assert own_cgroup_dirs(proc) == {"memory": (2, own), "pids": (2, own)}
    (own / "cgroup.controllers").write_text("cpu io\n")  # not delegated to us: nothing usable
    assert own_cgroup_dirs(proc) == {}


def test_v1_limits_and_counters(tmp_path: Path) -> None:
    memory_base, pids_base = tmp_path / "memory", tmp_path / "pids"
    memory_base.mkdir()
    pids_base.mkdir()
    manager = CgroupManager({"memory": Controller("memory", 1, memory_base), "pids": Controller("pids", 1, pids_base)})
    cgroup = manager.create("sbx1")
    memory_dir, pids_dir = memory_base / "sbx1", pids_base / "sbx1"
    (memory_dir / "memory.memsw.limit_in_bytes").write_text("0")
    cgroup.set_memory_limit(64 << 20)
    cgroup.set_pids_limit(40)
    assert (memory_dir / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (memory_dir / "memory.memsw.limit_in_bytes").read_text() == str(64 << 20)  # no swap on top
    assert (pids_dir / "pids.max").read_text() == "40"
    assert cgroup.procs_files == sorted([str(memory_dir / "cgroup.procs"), str(pids_dir / "cgroup.procs")])
    (memory_dir / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (memory_dir / "memory.failcnt").write_text("17\n")
    (pids_dir / "pids.events").write_text("max 5\n")
    counters = cgroup.counters()
    assert (counters.oom_kills, counters.memory_limit_hits, counters.pids_limit_hits) == (2, 17, 5)


def test_v2_limits_and_counters_share_one_directory(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    manager = CgroupManager({"memory": Controller("memory", 2, base), "pids": Controller("pids", 2, base)})
    cgroup = manager.create("sbx2")
    directory = base / "sbx2"
    (directory / "memory.swap.max").write_text("max")
    cgroup.set_memory_limit(1 << 30)
    cgroup.set_pids_limit(7)
    assert (directory / "memory.max").read_text() == str(1 << 30)
    assert (directory / "memory.swap.max").read_text() == "0"
    assert cgroup.procs_files == [str(directory / "cgroup.procs")]
    (directory / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    (directory / "pids.events").write_text("max 3\n")
    counters = cgroup.counters()
    assert (counters.oom_kills, counters.memory_limit_hits, counters.pids_limit_hits) == (1, 9, 3)


@pytest.mark.integration
def test_this_host_delegates_memory_and_pids_to_a_root_gateway() -> None:
    if os.geteuid() != 0 or "memory" not in Path("/proc/self/cgroup").read_text():
        pytest.skip("needs root and a memory cgroup (the CI machine has both)")
    manager = CgroupManager.detect()
    try:
        assert set(manager.controllers) == {"memory", "pids"}
        cgroup = manager.create("probe-test")
        cgroup.set_memory_limit(32 << 20)
        assert cgroup.counters().oom_kills == 0
        assert cgroup.remove()
    finally:
        manager.close()
    assert not any(controller.base.exists() for controller in manager.controllers.values())
