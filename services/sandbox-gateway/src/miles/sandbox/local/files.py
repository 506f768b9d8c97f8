"""WriteFile / ReadFile for the local backend: file I/O in a work dir the sandbox controls, done safely.

The gateway may run as root while the sandbox can create any symlink, FIFO or directory in its work dir. So a
path is walked one component at a time from a directory descriptor of the work dir with O_NOFOLLOW (a symlink
anywhere on the way — even one pointing back inside — is refused, never followed), the final file is opened
O_NOFOLLOW|O_NONBLOCK (a FIFO cannot block the gateway) and must be a regular file. Written files and created
directories are owned by the sandbox's uid. Callers pass components already checked by validation.py (no "..").
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from miles.sandbox.errors import UnsafePathError
from miles.sandbox.models import FileContent

_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(path: str, why: str) -> UnsafePathError:
    return UnsafePathError(f"path {path!r}: {why}", field="path")


def _open_dir(parent_fd: int, name: str, path: str, *, create: bool, owner: tuple[int, int] | None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise _refuse(path, "no such file or directory") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(path, f"{name!r} is a symlink or not a directory (symlinks are not followed)") from None
        raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=parent_fd)
        if owner is not None:
            os.chown(name, *owner, dir_fd=parent_fd, follow_symlinks=False)
    return _open_dir(parent_fd, name, path, create=False, owner=owner)


def _walk_to_parent(root: Path, parts: tuple[str, ...], *, create: bool, owner: tuple[int, int] | None) -> int:
    """A descriptor of the directory holding parts[-1], reached without following any symlink."""
    path = "/".join(parts)
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            next_fd = _open_dir(fd, name, path, create=create, owner=owner)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_final(parent_fd: int, name: str, path: str, flags: int, mode: int = 0o644) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=parent_fd)
    except FileNotFoundError:
        raise _refuse(path, "no such file") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
            raise _refuse(path, "is a symlink, directory or special file (only regular files)") from None
        raise


def write_file(root: Path, parts: tuple[str, ...], data: bytes, mode: int, owner: tuple[int, int] | None) -> int:
    """Create or replace the regular file root/parts with data; returns bytes written."""
    path = "/".join(parts)
    parent_fd = _walk_to_parent(root, parts, create=True, owner=owner)
    try:
        fd = _open_final(parent_fd, parts[-1], path, os.O_WRONLY | os.O_CREAT, mode)
    finally:
        os.close(parent_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _refuse(path, "is not a regular file")
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
        if owner is not None:
            os.fchown(fd, *owner)
    finally:
        os.close(fd)
    return len(data)


def read_file(root: Path, parts: tuple[str, ...], max_bytes: int) -> FileContent:
    """At most max_bytes of the regular file root/parts, its full size and whether it was truncated."""
    path = "/".join(parts)
    parent_fd = _walk_to_parent(root, parts, create=False, owner=None)
    try:
        fd = _open_final(parent_fd, parts[-1], path, os.O_RDONLY)
    finally:
        os.close(parent_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(path, "is not a regular file")
        chunks: list[bytes] = []
        remaining = max_bytes
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    size_bytes = max(info.st_size, len(data))
    return FileContent(data=data, size_bytes=size_bytes, truncated=len(data) < size_bytes)
