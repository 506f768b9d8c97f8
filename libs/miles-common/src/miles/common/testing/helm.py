"""Render a Helm chart with the real helm binary and hand the parsed objects to tests."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml


def helm_binary(repo_root: Path) -> str:
    """`.tools/bin/helm` (installed by `make setup`), else a helm on PATH."""
    local = repo_root / ".tools" / "bin" / "helm"
    if local.exists():
        return str(local)
    found = shutil.which("helm")
    if found is None:
        raise FileNotFoundError("helm not found: run `make setup` (it installs helm into .tools/bin)")
    return found


def run_helm(repo_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(repo_root), *args], capture_output=True, text=True, check=False)


def render_chart(
    chart_dir: Path,
    values_files: Sequence[Path] = (),
    set_values: Sequence[str] = (),
    *,
    release: str = "miles",
    namespace: str = "miles",
) -> list[dict[str, Any]]:
    """`helm template` of the chart; every non-empty document parsed. Raises RuntimeError with helm's stderr."""
    args = ["template", release, str(chart_dir), "--namespace", namespace]
    for path in values_files:
        args += ["-f", str(path)]
    for item in set_values:
        args += ["--set", item]
    result = run_helm(chart_dir.parents[1], *args)
    if result.returncode != 0:
        raise RuntimeError(result.stderr)
    return [document for document in yaml.safe_load_all(result.stdout) if document]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]
