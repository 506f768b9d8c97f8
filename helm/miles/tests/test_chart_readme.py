"""The chart README is generated from values.yaml (scripts/chart_docs.py), is up to date, documents every value,
and says how to install, scale each pool, plug in Prometheus/Grafana and use external Redis or object storage."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.integration  # runs helm and scripts/chart_docs.py

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "chart_docs.py"


def chart_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chart_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def leaf_keys(values: Any, path: str = "") -> list[str]:
    if isinstance(values, dict) and values:
        return [key for name, value in values.items() for key in leaf_keys(value, f"{path}{name}.")]
    return [path.rstrip(".")]


def test_readme_is_generated_from_the_current_values() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_value_is_documented(chart_dir: Path) -> None:
    values_text = (chart_dir / "values.yaml").read_text()
    documented = {doc.key for doc in chart_docs().value_docs(values_text)}
    undocumented = [
        key
        for key in leaf_keys(yaml.safe_load(values_text))
        if not any(key == doc or key.startswith(f"{doc}.") for doc in documented)
    ]
    assert undocumented == []
    assert {"nodePools.rollout.nodeSelector", "redis.externalUrl", "jobTemplates.weightSync.storeUrl"} <= documented


def test_an_undocumented_value_is_found() -> None:
    docs = chart_docs().value_docs("a:\n  # -- Documented.\n  b: 1\n  c: 2\n")
    assert [(doc.key, doc.type_name, doc.default, doc.description) for doc in docs] == [
        ("a.b", "int", "1", "Documented.")
    ]


def test_readme_covers_install_scaling_monitoring_and_external_storage(chart_dir: Path) -> None:
    readme = (chart_dir / "README.md").read_text()
    for heading in (
        "## Install",
        "## Node pools and scaling each pool",
        "## Prometheus and Grafana",
        "## External Redis and object storage",
        "## Values",
    ):
        assert heading in readme
    for needle in ("helm install miles helm/miles", "redis.externalUrl", "storeUrl", "grafana_dashboard"):
        assert needle in readme
    assert '| `jobTemplates.trainer.checkpoints.size` | string | `"200Gi"` |' in readme
