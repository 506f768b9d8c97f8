"""Fixtures of the chart tests: a renderer bound to this chart and its CI values files."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from miles.common.testing.helm import render_chart

CHART_DIR = Path(__file__).resolve().parents[1]
Renderer = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def chart_dir() -> Path:
    return CHART_DIR


@pytest.fixture(scope="session")
def render() -> Renderer:
    """render(["ci-values.yaml", ...], ["key=value", ...]) -> objects; files are under helm/miles/ci/."""

    def _render(values_files: Sequence[str] = (), set_values: Sequence[str] = ()) -> list[dict[str, Any]]:
        return render_chart(CHART_DIR, [CHART_DIR / "ci" / name for name in values_files], set_values)

    return _render
