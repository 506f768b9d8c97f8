"""Build one environment server's own interpreter: `.envs/<name>/`, from `requirements/envs/<name>.txt`.

Each connector whose package pins conflict with the services' (verifiers needs openai<3, Harbor Python 3.12)
runs in its own virtualenv, installed reproducibly: the requirements file is a full lock (every distribution
pinned, installed with --no-deps, so nothing is resolved at install time), plus miles-envserver (standard
library only). A first line `# python: 3.12` asks for that interpreter (see `find_python`); the default is the
one running this script. The venv is rebuilt only when the lock file or miles-envserver's pyproject changed
(a stamp file holds their hash). Usage: python scripts/make_env.py <name> [--envs-dir .envs] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "requirements" / "envs"
ENVSERVER = ROOT / "libs" / "miles-envserver"
_PYTHON_LINE = re.compile(r"^#\s*python:\s*(\d+\.\d+)\s*$")


def wanted_python(lock: Path) -> str | None:
    first = lock.read_text().splitlines()[:1]
    match = _PYTHON_LINE.match(first[0]) if first else None
    return match.group(1) if match else None


def find_python(version: str | None, envs_dir: Path) -> str:
    """The interpreter for `version`: this one when it matches (or none is asked), else pythonX.Y on PATH, else a
    portable CPython unpacked by scripts/portable_python.py (when that script exists)."""
    if version is None or version == f"{sys.version_info.major}.{sys.version_info.minor}":
        return sys.executable
    on_path = shutil.which(f"python{version}")
    if on_path:
        return on_path
    portable = ROOT / "scripts" / "portable_python.py"
    if portable.exists():
        out = subprocess.run(
            [sys.executable, str(portable), version, "--dest", str(envs_dir / f".python-{version}")],
            check=True,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip().splitlines()[-1]
    raise SystemExit(f"no Python {version}: install python{version} (the lock file asks for it)")


def stamp_of(lock: Path, python: str) -> str:
    digest = hashlib.sha256(lock.read_bytes())
    digest.update((ENVSERVER / "pyproject.toml").read_bytes())
    digest.update(python.encode())
    return digest.hexdigest()


def build(name: str, envs_dir: Path, force: bool) -> Path:
    lock = LOCKS / f"{name}.txt"
    if not lock.exists():
        known = sorted(p.stem for p in LOCKS.glob("*.txt"))
        raise SystemExit(f"no lock file {lock.relative_to(ROOT)}; environments: {', '.join(known)}")
    python = find_python(wanted_python(lock), envs_dir)
    venv = envs_dir / name
    stamp_file = venv / ".miles-stamp"
    stamp = stamp_of(lock, python)
    if not force and stamp_file.exists() and stamp_file.read_text() == stamp:
        print(f"{venv}: up to date")
        return venv
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", "-r", str(lock)], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ENVSERVER)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "check"], check=True)
    stamp_file.write_text(stamp)
    print(f"{venv}: built from {lock.relative_to(ROOT)}")
    return venv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--envs-dir", type=Path, default=ROOT / ".envs")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    build(args.name, args.envs_dir.resolve(), args.force)


if __name__ == "__main__":
    main()
