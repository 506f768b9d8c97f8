"""No service keeps its own copy of a helper that miles-common owns (one implementation, one meaning).

Every `def` in the services' and the CLI's sources is compared with the names of the shared helpers below; a
leading underscore does not hide a copy (`_free_port` counts). A service that needs different behaviour adapts
the shared helper's result in a differently named function that calls it (weight-sync's `reported_version`).
Limit: only function names are compared, so a copy under another name is not found.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_HELPERS = {
    "free_port": "miles.common.ports",
    "parse_weight_version": "miles.common.contracts.weight_version",
    "weight_version_number": "miles.common.contracts.weight_version",  # the session server's former copy
    "parse_version": "miles.common.contracts.weight_version",  # weight-sync's former copy
    "sample_problem": "miles.common.contracts.samples",
    "is_loopback_host": "miles.common.auth",
    "check_token_setting": "miles.common.auth",
    "check_token_length": "miles.common.auth",
    "tokens_match": "miles.common.auth",
    "bearer_of": "miles.common.auth",
    "bearer_headers": "miles.common.auth",
}
SOURCE_ROOTS = sorted([*REPO_ROOT.glob("services/*/src"), *REPO_ROOT.glob("cli/src")])


def defined_functions(path: Path) -> list[tuple[str, int]]:
    """(name, line) of every function and method defined in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.name, node.lineno) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def copies_under(roots: list[Path], base: Path = REPO_ROOT) -> list[str]:
    """'<path>:<line> def <name> (use <module>)' for each function named like a shared helper."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for name, line in defined_functions(path):
                module = SHARED_HELPERS.get(name.lstrip("_"))
                if module is not None:
                    found.append(f"{path.relative_to(base)}:{line} def {name} (use {module})")
    return found


def test_the_sources_are_found() -> None:
    assert len(SOURCE_ROOTS) >= 9, SOURCE_ROOTS


def test_no_service_defines_a_shared_helper() -> None:
    assert copies_under(SOURCE_ROOTS) == []


@pytest.mark.parametrize(
    "source",
    [
        "def parse_weight_version(value: object) -> int | None:\n    return None\n",
        "class Ports:\n    @staticmethod\n    def _free_port(address: str) -> int:\n        return 0\n",
        "async def sample_problem(sample: object) -> None:\n    return None\n",
    ],
)
def test_a_copy_is_found(source: str, tmp_path: Path) -> None:
    """The guard can fail: a copy (private, a method, async) in a service source is reported."""
    (tmp_path / "copy.py").write_text(source)
    assert len(copies_under([tmp_path], base=tmp_path)) == 1
