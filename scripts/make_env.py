"""Build one environment server's own interpreter: `.envs/<name>/`, from `requirements/envs/<name>.txt`.

Each connector whose package pins conflict with the services' (verifiers needs openai<3, Harbor Python 3.12)
runs in its own virtualenv, installed reproducibly: the requirements file is a full lock (every distribution
pinned, installed with --no-deps, so nothing is resolved at install time), plus miles-envserver (standard
library only), plus the repository's own packages listed in `requirements/envs/<name>.local` (see
`local_packages`). A first line `# python: 3.12` asks for that interpreter (see `find_python`); the default is the
one running this script. The venv is rebuilt only when the lock file, the .local list or the pyproject of
miles-envserver or of a listed package changed (a stamp file holds their hash). `pip check` must pass, except
for requirements that the lock names on a line `# omitted: NAME NAME ...` (see `omitted`).
Usage: python scripts/make_env.py <name> [--envs-dir .envs] [--force]
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
_OMITTED_LINE = re.compile(r"^#\s*omitted:\s*(.+)$")
_NOT_INSTALLED = re.compile(r"^\S+ \S+ requires (\S+), which is not installed\.$")


def wanted_python(lock: Path) -> str | None:
    first = lock.read_text().splitlines()[:1]
    match = _PYTHON_LINE.match(first[0]) if first else None
    return match.group(1) if match else None


def _runs(python: str, version: str) -> bool:
    """Whether `python` starts and is `version` (a pyenv shim of a version not selected exits 127)."""
    probe = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
    )
    return probe.returncode == 0 and probe.stdout.strip() == version


def find_python(version: str | None, envs_dir: Path) -> str:
    """The interpreter for `version`: this one when it matches (or none is asked), else a pythonX.Y on PATH that
    runs, else an installed one scripts/find_python.py finds (pyenv, uv, /usr)."""
    if version is None or version == f"{sys.version_info.major}.{sys.version_info.minor}":
        return sys.executable
    on_path = shutil.which(f"python{version}")
    if on_path and _runs(on_path, version):
        return on_path
    finder = ROOT / "scripts" / "find_python.py"
    if finder.exists():
        out = subprocess.run(
            [sys.executable, str(finder), version, "--dest", str(envs_dir / f".python-{version}")],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise SystemExit(f"no Python {version}: {out.stderr.strip()}")
        return out.stdout.strip().splitlines()[-1]
    raise SystemExit(f"no Python {version}: install python{version} (the lock file asks for it)")


def local_packages(name: str) -> list[Path]:
    """The folders listed in `requirements/envs/<name>.local`, one a line relative to the repository root (`#`
    comments): packages of this repository (an example environment) installed editable with --no-deps, so their
    dependencies must be in the lock."""
    listing = LOCKS / f"{name}.local"
    if not listing.exists():
        return []
    packages = []
    for line in listing.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        package = ROOT / entry
        if not (package / "pyproject.toml").exists():
            raise SystemExit(f"{listing.relative_to(ROOT)}: {entry} is not a package folder (no pyproject.toml)")
        packages.append(package)
    return packages


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def omitted(lock: Path) -> set[str]:
    """Distributions the lock leaves out on purpose: declared by a package but not imported by what the connector
    uses (OpenEnv's web UI, gradio), named on header lines `# omitted: NAME NAME ...`; pip check may miss them."""
    names: set[str] = set()
    for line in lock.read_text().splitlines():
        match = _OMITTED_LINE.match(line)
        if match:
            names.update(_canonical(name) for name in match.group(1).replace(",", " ").split())
    return names


def pip_check(venv: Path, lock: Path) -> None:
    """`pip check`, tolerating only "X requires Y, which is not installed." for a Y of the lock's omitted names."""
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "check"], capture_output=True, text=True)
    allowed = omitted(lock)
    problems = [
        line
        for line in done.stdout.splitlines()
        if line.strip()
        and not ((match := _NOT_INSTALLED.match(line.strip())) and _canonical(match.group(1)) in allowed)
    ]
    if done.returncode != 0 and (problems or not done.stdout.strip()):
        raise SystemExit(f"pip check failed in {venv}:\n" + "\n".join(problems or [done.stderr.strip()]))


def stamp_of(lock: Path, python: str, packages: list[Path]) -> str:
    digest = hashlib.sha256(lock.read_bytes())
    digest.update((ENVSERVER / "pyproject.toml").read_bytes())
    for package in packages:
        digest.update(str(package.relative_to(ROOT)).encode())
        digest.update((package / "pyproject.toml").read_bytes())
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
    packages = local_packages(name)
    stamp = stamp_of(lock, python, packages)
    if not force and stamp_file.exists() and stamp_file.read_text() == stamp:
        print(f"{venv}: up to date")
        return venv
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", "-r", str(lock)], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ENVSERVER)], check=True)
    for package in packages:
        subprocess.run([*pip, "--no-deps", "-e", str(package)], check=True)
    pip_check(venv, lock)
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
