"""The local backend's file I/O in a sandbox-controlled directory: no symlink is ever followed, FIFOs and
directories are refused without blocking, and written files belong to the sandbox's uid."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from miles.sandbox.errors import UnsafePathError
from miles.sandbox.local.files import read_file, write_file


def test_write_creates_parents_owned_by_the_sandbox_uid(tmp_path: Path) -> None:
    owner = (200999, 200999) if os.geteuid() == 0 else None
    assert write_file(tmp_path, ("a", "b", "c.txt"), b"hello", 0o640, owner) == 5
    target = tmp_path / "a" / "b" / "c.txt"
    assert target.read_bytes() == b"hello"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    if owner is not None:
        assert (target.stat().st_uid, (tmp_path / "a").stat().st_uid) == (200999, 200999)
    assert write_file(tmp_path, ("a", "b", "c.txt"), b"hi", 0o644, owner) == 2
    assert target.read_bytes() == b"hi"  # replaced, not appended


def test_read_caps_and_reports_the_full_size(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 1000)
    content = read_file(tmp_path, ("f",), 10)
    assert (content.data, content.size_bytes, content.truncated) == (b"x" * 10, 1000, True)
    assert read_file(tmp_path, ("f",), 5000).truncated is False


@pytest.mark.parametrize("target", ["/etc/passwd", "inside.txt", "."])
def test_symlinks_are_never_followed(tmp_path: Path, target: str) -> None:
    (tmp_path / "inside.txt").write_text("inside")
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "dirlink").symlink_to("/etc")
    with pytest.raises(UnsafePathError):
        read_file(tmp_path, ("link",), 100)
    with pytest.raises(UnsafePathError):
        read_file(tmp_path, ("dirlink", "passwd"), 100)
    with pytest.raises(UnsafePathError):
        write_file(tmp_path, ("link",), b"x", 0o644, None)
    with pytest.raises(UnsafePathError):
        write_file(tmp_path, ("dirlink", "evil"), b"x", 0o644, None)
    assert not Path("/etc/evil").exists()
    assert (tmp_path / "inside.txt").read_text() == "inside"


def test_fifos_and_directories_are_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for parts in (("fifo",), ("dir",)):
        with pytest.raises(UnsafePathError):
            read_file(tmp_path, parts, 100)
        with pytest.raises(UnsafePathError):
            write_file(tmp_path, parts, b"x", 0o644, None)


def test_missing_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafePathError):
        read_file(tmp_path, ("missing", "file"), 100)
