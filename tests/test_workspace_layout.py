"""The workspace keeps the shape docs/architecture.md §2 and §6 give it: one distribution per service, pinned, torch
only where it is needed, a console entry point, a README, a non-root Dockerfile, and tests."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

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
    final_entrypoint = dockerfile.rsplit("\nENTRYPOINT ", 1)[1]  # the environment servers' targets come before
    assert 'exec \\"miles-$MILES_IMAGE_SERVICE\\"' in final_entrypoint, "the console script"


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


ENV_LOCKS = sorted((REPO_ROOT / "requirements" / "envs").glob("*.txt"))


def dockerfile_stages() -> dict[str, tuple[str, str]]:
    """Every named stage of the Dockerfile: name -> (what it is FROM, its instructions)."""
    stages = {}
    for text in re.split(r"^FROM ", (REPO_ROOT / "Dockerfile").read_text(), flags=re.MULTILINE)[1:]:
        header, _, body = text.partition("\n")
        named = re.fullmatch(r"(\S+) AS (\S+)", header.strip())
        if named:
            stages[named.group(2)] = (named.group(1), body)
    return stages


def base_python(stage: str) -> str:
    """The X.Y of the python:X.Y-slim image a stage is built on (following stages, then the global ARGs)."""
    stages = dockerfile_stages()
    while stage in stages:
        stage = stages[stage][0]
    arg = re.fullmatch(r"\$\{(\w+)\}", stage)
    assert arg is not None, f"stage built on {stage}, not on a PYTHON_*IMAGE build argument"
    default = re.search(rf"^ARG {arg.group(1)}=python:(\d+\.\d+)-slim$", (REPO_ROOT / "Dockerfile").read_text(), re.M)
    assert default is not None, f"no `ARG {arg.group(1)}=python:X.Y-slim` before the first FROM"
    return default.group(1)


def make_env_module() -> Any:
    spec = importlib.util.spec_from_file_location("make_env", REPO_ROOT / "scripts" / "make_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("lock", ENV_LOCKS, ids=lambda path: path.stem)
def test_every_environment_lock_has_an_image_target_on_its_python(lock: Path) -> None:
    """`docker build --target envserver-<name>` builds the interpreter make_env.py builds locally: on the Python
    the lock asks for (`# python: X.Y`, else the services' 3.11), with the lock, its .local packages and
    miles-envserver copied where make_env.py looks for them, first on PATH, run as a non-root user."""
    name = lock.stem
    stages = dockerfile_stages()
    assert f"envserver-{name}" in stages, f"no stage `FROM envserver-python-X.Y AS envserver-{name}`"
    base, body = stages[f"envserver-{name}"]
    make_env = make_env_module()
    wanted = make_env.wanted_python(lock) or base_python("runtime")
    assert base == f"envserver-python-{wanted}" and base_python(base) == wanted, f"{name} wants Python {wanted}"
    assert "WORKDIR /opt/miles\n" in stages[base][1]
    for path in ("scripts/make_env.py", "libs/miles-envserver"):
        assert f"COPY {path} {path}\n" in stages[base][1], path
    copied = " ".join(line for line in body.splitlines() if line.startswith("COPY "))
    assert f"requirements/envs/{name}.txt" in copied
    if (lock.parent / f"{name}.local").exists():
        assert f"requirements/envs/{name}.local" in copied
    for package in make_env.local_packages(name):
        folder = package.relative_to(REPO_ROOT)
        assert f"COPY {folder} {folder}" in copied, f"{name}.local lists {folder}"
    assert f"\nRUN python scripts/make_env.py {name}\n" in body
    assert f"\nENV PATH=/opt/miles/.envs/{name}/bin:$PATH\n" in body
    assert "\nUSER 10001\n" in body
    assert 'ENTRYPOINT ["python", "-m", "miles.envserver"]' in body


def test_the_chart_names_an_image_for_every_environment_target() -> None:
    """Each connector's image in the chart (jobTemplates.envServer.images) is built by an envserver-<name> target,
    and every such target has its lock."""
    images = yaml.safe_load((REPO_ROOT / "helm" / "miles" / "values.yaml").read_text())["jobTemplates"]["envServer"]
    targets = {
        stage.removeprefix("envserver-")
        for stage in dockerfile_stages()
        if stage.startswith("envserver-") and not stage.startswith("envserver-python-")
    }
    assert targets == {lock.stem for lock in ENV_LOCKS}
    assert {connector.replace("_", "-") for connector in images["images"]} == targets
    for connector, image in images["images"].items():
        assert image["repository"] == f"miles-envserver-{connector.replace('_', '-')}", connector


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
