"""The workspace keeps the shape docs/architecture.md §2 and §6 give it: one distribution per service, pinned, torch
only where it is needed, a console entry point, a README, a non-root Dockerfile, and tests."""

from __future__ import annotations

import contextlib
import io
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICES = sorted(path.parent for path in REPO_ROOT.glob("services/*/pyproject.toml"))
LIBS = sorted(path.parent for path in REPO_ROOT.glob("libs/*/pyproject.toml"))
CLI = REPO_ROOT / "cli"
"""The `miles` command and `miles up`: a distribution, not a service (no image, no probes)."""
TORCH_ALLOWED = {"miles-engine", "miles-trainer", "miles-weight-sync", "miles-model"}
EXPECTED_SERVICES = {
    "controller",
    "session-server",
    "rollout-router",
    "engine",
    "rollout-worker",
    "buffer",
    "trainer",
    "weight-sync",
    "sandbox-gateway",
}
_PIN = re.compile(r"^[A-Za-z0-9_.\-]+(\[[A-Za-z0-9_,\-]+\])?==[0-9][0-9A-Za-z.+\-]*(\s*;.*)?$")


def load_project(directory: Path) -> dict[str, object]:
    with (directory / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)["project"]  # type: ignore[no-any-return]


def test_every_service_of_the_design_has_a_distribution() -> None:
    assert {path.name for path in SERVICES} == EXPECTED_SERVICES


@pytest.mark.parametrize("directory", [*SERVICES, *LIBS, CLI], ids=lambda path: path.name)
def test_direct_dependencies_are_pinned(directory: Path) -> None:
    project = load_project(directory)
    dependencies = list(project.get("dependencies", []))  # type: ignore[call-overload]
    for extra in dict(project.get("optional-dependencies", {})).values():  # type: ignore[call-overload]
        dependencies += list(extra)
    unpinned = [dep for dep in dependencies if not _PIN.match(dep)]
    assert unpinned == [], f"{directory.name}: pin with == : {unpinned}"


@pytest.mark.parametrize("directory", [*SERVICES, *LIBS, CLI], ids=lambda path: path.name)
def test_only_engine_trainer_weightsync_and_model_depend_on_torch(directory: Path) -> None:
    project = load_project(directory)
    names = {re.split(r"[=<>\[;]", dep)[0].strip().lower() for dep in project.get("dependencies", [])}  # type: ignore[attr-defined]
    if project["name"] in TORCH_ALLOWED:
        return
    assert "torch" not in names, f"{project['name']} must not depend on torch"
    assert "miles-model" not in names, f"{project['name']} must not depend on miles-model (torch)"


@pytest.mark.parametrize("directory", SERVICES, ids=lambda path: path.name)
def test_service_has_entry_point_readme_and_tests(directory: Path) -> None:
    project = load_project(directory)
    scripts = dict(project.get("scripts", {}))  # type: ignore[call-overload]
    assert f"miles-{directory.name}" in scripts
    readme = (directory / "README.md").read_text()
    assert "**Owns**" in readme
    assert "**Does not own**" in readme
    assert list((directory / "tests").glob("test_*.py")), "every service has tests"


def test_cli_has_the_miles_command_readme_and_tests() -> None:
    project = load_project(CLI)
    assert project["name"] == "miles-cli"
    assert "miles" in dict(project.get("scripts", {}))  # type: ignore[call-overload]
    readme = (CLI / "README.md").read_text()
    assert "**Owns**" in readme and "**Does not own**" in readme
    assert list((CLI / "tests").glob("test_*.py"))


def test_one_parametrised_dockerfile_runs_as_a_non_root_user() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert not list(REPO_ROOT.glob("services/*/Dockerfile")), "one Dockerfile at the root, --build-arg SERVICE=..."
    assert re.search(r"^ARG SERVICE\b", dockerfile, re.MULTILINE)
    assert re.search(r"^ARG PYTHON_IMAGE=python:[0-9.]+-slim$", dockerfile, re.MULTILINE)
    user_lines = [line for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert user_lines and user_lines[-1].split()[1] not in ("root", "0"), "the image must run as a non-root user"
    assert re.search(r"^FROM svc-\$\{SERVICE\}$", dockerfile, re.MULTILINE)
    assert re.search(r"^ENV MILES_IMAGE_SERVICE=\$\{SERVICE\}$", dockerfile, re.MULTILINE)
    assert 'exec \\"miles-$MILES_IMAGE_SERVICE\\"' in dockerfile.split("\nENTRYPOINT ", 1)[1], "the console script"


@pytest.mark.parametrize("directory", SERVICES, ids=lambda path: path.name)
def test_the_dockerfile_builds_every_service(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each service has its stage (bound to every interface, its ports exposed), and the install step's own code,
    run here, finds the service's pyproject, the libraries and every miles package it depends on."""
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", dockerfile, flags=re.MULTILINE)
    stage = [text for text in stages if text.startswith(f"runtime AS svc-{directory.name}\n")]
    assert len(stage) == 1, f"no stage `FROM runtime AS svc-{directory.name}` in the Dockerfile"
    assert re.search(r"^ENV MILES_[A-Z]+_HOST=0\.0\.0\.0\b", stage[0], re.MULTILINE), "the service binds 0.0.0.0"
    assert re.search(r"^EXPOSE [0-9]+", stage[0], re.MULTILINE)
    closure = re.search(r"<<'PY'\n(.*?)\nPY\n", dockerfile, re.DOTALL)
    assert closure is not None, "the install step's package list (python - <<'PY' ... PY)"
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(sys, "argv", ["-", directory.name])
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(closure.group(1), "Dockerfile", "exec"), {"__name__": "__main__"})
    packages = {REPO_ROOT / line for line in output.getvalue().split()}
    project = load_project(directory)
    wanted = {re.split(r"[=<>\[;]", dep)[0].strip() for dep in project.get("dependencies", [])}  # type: ignore[attr-defined]
    names = {str(load_project(package)["name"]) for package in packages}
    assert directory in packages and REPO_ROOT / "libs" / "miles-common" in packages
    assert {name for name in wanted if name.startswith("miles-")} <= names
    assert f"miles-{directory.name}" in dict(project.get("scripts", {}))  # type: ignore[call-overload]


def test_protos_are_versioned_and_enums_start_unspecified() -> None:
    protos = sorted(REPO_ROOT.glob("protos/miles/*/v*/*.proto"))
    assert {path.parts[-3] for path in protos} >= {"common", "buffer", "weightsync", "sandbox", "trainer", "router"}
    for path in protos:
        text = path.read_text()
        package = re.search(r"^package ([\w.]+);", text, re.MULTILINE)
        assert package and package.group(1) == f"miles.{path.parts[-3]}.{path.parts[-2]}", path
        for enum_name, body in re.findall(r"enum (\w+) \{(.*?)\}", text, re.DOTALL):
            first_value = re.search(r"(\w+)\s*=\s*(\d+);", body)
            assert first_value is not None
            assert first_value.group(1).endswith("_UNSPECIFIED") and first_value.group(2) == "0", f"{path}:{enum_name}"


def test_every_rpc_has_its_own_request_and_response() -> None:
    for path in REPO_ROOT.glob("protos/miles/*/v*/*.proto"):
        rpcs = re.findall(r"rpc (\w+)\((?:stream )?(\w+)\) returns \((?:stream )?(\w+)\)", path.read_text())
        requests = [request for _, request, _ in rpcs]
        assert len(requests) == len(set(requests)), f"{path}: a request message is shared between RPCs"
        for name, request, response in rpcs:
            if request.endswith("Chunk") or response.endswith("Chunk") or response.endswith("Event"):
                continue  # streamed element types, not request/response envelopes
            assert request == f"{name}Request", f"{path}: {name} takes {request}"
            assert response == f"{name}Response", f"{path}: {name} returns {response}"
