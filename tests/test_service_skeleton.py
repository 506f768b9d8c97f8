"""Every service has the same rooms (docs/names.md): a reader who knows one service knows where to look in the next.

`main.py` wires settings → core → serve; `core.py` holds the behaviour and imports no web or RPC framework (the
transports live in `http_api.py` / `grpc_api.py`); `settings.py`, `errors.py` and `metrics.py` are the one
settings class, error hierarchy and metric set of the service. Limit: the core's *own* imports are checked;
miles.common.errors maps errors to gRPC status codes, so importing the core still loads grpc's StatusCode.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE_PACKAGES = sorted(
    package for package in (ROOT / "services").glob("*/src/miles/*") if (package / "__init__.py").exists()
)
REQUIRED = ("main.py", "core.py", "settings.py", "errors.py", "metrics.py")
TRANSPORTS = ("http_api.py", "grpc_api.py")
FRAMEWORKS = {"fastapi", "starlette", "uvicorn", "grpc", "sse_starlette", "httpx_sse"}


def imported_top_level_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules


def test_every_service_is_found() -> None:
    assert len(SERVICE_PACKAGES) == len(list((ROOT / "services").iterdir())), SERVICE_PACKAGES


@pytest.mark.parametrize("package", SERVICE_PACKAGES, ids=lambda p: p.parts[-4])
def test_service_has_the_skeleton(package: Path) -> None:
    missing = [name for name in REQUIRED if not (package / name).is_file()]
    assert not missing, f"{package.relative_to(ROOT)} lacks {missing}"
    assert any((package / name).is_file() for name in TRANSPORTS), f"{package} has no http_api.py or grpc_api.py"
    assert not (package / "service.py").exists(), "service.py is ambiguous: the core is core.py, transports *_api.py"


@pytest.mark.parametrize("package", SERVICE_PACKAGES, ids=lambda p: p.parts[-4])
def test_core_imports_no_framework(package: Path) -> None:
    used = imported_top_level_modules(package / "core.py") & FRAMEWORKS
    assert not used, f"{package.relative_to(ROOT)}/core.py imports {sorted(used)}: move it to a transport module"


@pytest.mark.parametrize("package", SERVICE_PACKAGES, ids=lambda p: p.parts[-4])
def test_main_builds_from_settings_and_core(package: Path) -> None:
    """main.py is the wiring: it loads the settings class and builds on the core (directly or via the transport)."""
    name = package.name
    source = (package / "main.py").read_text()
    assert f"miles.{name}.settings" in source, f"{name}/main.py does not load its settings class"
    wired = [f"miles.{name}.{module}" for module in ("core", "http_api", "grpc_api")]
    assert any(module in source for module in wired), f"{name}/main.py does not wire core or a transport"
