"""find_host_tools reads what the installed bwrap supports from its --help: no --seccomp (bubblewrap before
0.1.7) refuses the local backend, so no sandbox ever runs without the filter; --disable-userns (0.8.0 and
later) is used where present. Fake bwraps here stand in for older versions; the real one is checked too."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from miles.sandbox.errors import BackendUnusableError
from miles.sandbox.local.bwrap import find_host_tools

pytestmark = pytest.mark.integration  # runs bwrap (real and fake ones)


def _fake_bwrap(directory: Path, help_text: str) -> str:
    path = directory / "bwrap"
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{help_text}\nEOF\n")
    path.chmod(stat.S_IRWXU)
    return str(path)


def test_a_bwrap_without_seccomp_is_refused(tmp_path: Path) -> None:
    bwrap = _fake_bwrap(tmp_path, "usage: bwrap [OPTIONS...] [--] COMMAND [ARGS...]\n    --unshare-user\n")
    with pytest.raises(BackendUnusableError, match="no --seccomp option") as refused:
        find_host_tools(bwrap)
    assert refused.value.field == "bwrap_path"


def test_disable_userns_is_used_only_where_bwrap_has_it(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old = _fake_bwrap(tmp_path / "old", "    --seccomp FD\n    --unshare-user\n")
    new = _fake_bwrap(
        tmp_path / "new", "    --seccomp FD\n    --disable-userns   Disable further use of user namespaces\n"
    )
    assert not find_host_tools(old).bwrap_disables_userns
    assert find_host_tools(new).bwrap_disables_userns


def test_the_installed_bwrap_is_read_as_it_is() -> None:
    bwrap = shutil.which("bwrap")
    assert bwrap is not None, "the local backend tests need bubblewrap (apt-get install -y bubblewrap)"
    help_text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, check=False)
    tools = find_host_tools("bwrap")
    assert tools.bwrap == bwrap
    assert tools.bwrap_disables_userns == ("--disable-userns" in help_text.stdout + help_text.stderr)
