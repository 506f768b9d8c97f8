"""Mirror every service's settings class into helm/miles/values.yaml (`<component>.settings`).

CONTRIBUTING.md (how we write code): one typed settings class per service, its fields mirrored in the chart with
the same names. This script rewrites the block between the `# BEGIN generated` and `# END generated` markers of
each component's `settings:` with every field (default value and docstring), except those the chart sets itself
(host, ports, Redis URL, secrets, the controller's shared_pools). `--check` exits 1 when values.yaml is out of
date; a chart test runs it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter

REPO_ROOT = Path(__file__).resolve().parents[1]
VALUES_PATH = REPO_ROOT / "helm" / "miles" / "values.yaml"
COMPONENT_SETTINGS = {
    "controller": "miles.controller.settings:ControllerSettings",
    "sessionServer": "miles.session.settings:SessionSettings",
    "rolloutRouter": "miles.router.settings:RouterSettings",
    "buffer": "miles.buffer.settings:BufferSettings",
    "sandboxGateway": "miles.sandbox.settings:SandboxSettings",
}
# shared_pools: the controller's pools come from the chart's top-level sharedPools (MILES_CONTROLLER_SHARED_POOLS).
# kubernetes_kueue: from the chart's top-level kueue.enabled (MILES_CONTROLLER_KUBERNETES_KUEUE), beside its RBAC.
CHART_MANAGED = {"host", "port", "metrics_port", "admin_grpc_port", "redis_url", "shared_pools", "kubernetes_kueue"}
# Where an in-cluster install needs another default than a local process (field -> value).
CHART_DEFAULTS: dict[str, dict[str, Any]] = {
    "sandboxGateway": {"backend": "kubernetes"},
    "controller": {"backend": "kubernetes"},
    "rolloutRouter": {"k8s_discovery": True},
}
_BLOCK_RE = re.compile(
    r"(?P<indent>[ ]*)# BEGIN generated from (?P<ref>[\w.:]+)[^\n]*\n.*?(?P=indent)# END generated[^\n]*\n", re.DOTALL
)


def yaml_scalar(value: Any) -> str:
    """A value as one line of YAML (flow style for lists and maps)."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    dumped = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return dumped.removesuffix("\n...").removesuffix(" ...")


def settings_block(reference: str, indent: str, secret_fields: set[str], chart_defaults: dict[str, Any]) -> str:
    module_name, class_name = reference.split(":")
    settings_class = getattr(importlib.import_module(module_name), class_name)
    lines = [f"{indent}# BEGIN generated from {reference} (scripts/sync_chart_settings.py; do not edit)\n"]
    for name, field in settings_class.model_fields.items():
        if name in CHART_MANAGED or name in secret_fields:
            continue
        doc = " ".join((field.description or "").split())
        default = TypeAdapter(field.annotation).dump_python(field.get_default(call_default_factory=True), mode="json")
        if name in chart_defaults:
            doc += f" (chart default; the service's own default is {yaml_scalar(default)})"
            default = chart_defaults[name]
        lines.append(f"{indent}# -- {doc}\n")
        lines.append(f"{indent}{name}: {yaml_scalar(default)}\n")
    lines.append(f"{indent}# END generated\n")
    return "".join(lines)


def render(values_text: str) -> str:
    values = yaml.safe_load(values_text)

    def replace(match: re.Match[str]) -> str:
        reference = match.group("ref")
        component = next(key for key, ref in COMPONENT_SETTINGS.items() if ref == reference)
        secret_fields = {entry["field"] for entry in values[component].get("secretEnv", [])}
        secret_fields |= set(values[component].get("links", {}))
        secret_fields |= set(values[component].get("fullnameSettings", {}))
        return settings_block(reference, match.group("indent"), secret_fields, CHART_DEFAULTS.get(component, {}))

    return _BLOCK_RE.sub(replace, values_text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if values.yaml is not in sync")
    args = parser.parse_args()
    current = VALUES_PATH.read_text()
    updated = render(current)
    if args.check:
        if updated != current:
            print("helm/miles/values.yaml is out of sync with the settings classes: run make chart-settings")
            return 1
        return 0
    VALUES_PATH.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
