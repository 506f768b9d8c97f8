"""Validate custom resources (objects of CRD kinds) against their CRDs' own OpenAPI schemas, vendored in `crds/`.

`kubernetes_validate` knows only the built-in kinds; the chart and the controller also make objects of kinds that
add-ons define (LeaderWorkerSet ...). Each file in `crds/` holds one CRD version's `openAPIV3Schema` as the add-on's
pinned release ships it (its header names the repository, tag and path), plus the group, version, kind and plural.

Validation is what a strict API server does with such an object: JSON-schema checks (types, enums, required,
bounds, patterns), and unknown fields refused (the server's strict field validation) wherever the schema does not
preserve them. Limits: CEL rules (`x-kubernetes-validations`), list-map uniqueness and the embedded objects'
metadata (names, labels) are not checked; the built-in kinds inside a custom resource (e.g. a pod template) are
checked only as far as the CRD's own copy of their schema goes. Test code: imported by tests only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import yaml

CRD_DIR = Path(__file__).parent / "crds"


@dataclass(frozen=True)
class CustomResourceSchema:
    """One vendored CRD version: what it is called in the API and its schema (unknown fields closed)."""

    group: str
    version: str
    kind: str
    plural: str
    schema: dict[str, Any]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


def _closed(node: Any) -> Any:
    """`node` with `additionalProperties: false` on every object schema that lists properties and neither sets
    additionalProperties nor preserves unknown fields (the API server's pruning / strict field validation)."""
    if isinstance(node, list):
        return [_closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    closed = {key: _closed(value) for key, value in node.items()}
    open_ended = "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in node and not open_ended:
        closed["additionalProperties"] = False
    return closed


@functools.cache
def custom_resource_schemas() -> dict[tuple[str, str], CustomResourceSchema]:
    """Every vendored schema, by (apiVersion, kind)."""
    schemas: dict[tuple[str, str], CustomResourceSchema] = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        schema = CustomResourceSchema(
            group=data["group"],
            version=data["version"],
            kind=data["kind"],
            plural=data["plural"],
            schema=_closed(data["openAPIV3Schema"]),
        )
        schemas[(schema.api_version, schema.kind)] = schema
    return schemas


def schema_of(api_version: str, kind: str) -> CustomResourceSchema:
    """The vendored schema of `kind` in `api_version`; ValueError when none is vendored."""
    schemas = custom_resource_schemas()
    if (api_version, kind) not in schemas:
        known = sorted(f"{version} {name}" for version, name in schemas)
        raise ValueError(f"no vendored CRD schema for {api_version} {kind} (vendored: {known})")
    return schemas[(api_version, kind)]


def validate_custom_object(obj: dict[str, Any]) -> None:
    """Raise ValueError naming the first bad field (as a JSON path) when `obj` does not satisfy its CRD's schema,
    or when no schema for its apiVersion and kind is vendored."""
    api_version, kind = str(obj.get("apiVersion", "")), str(obj.get("kind", ""))
    schema = schema_of(api_version, kind)
    validator = jsonschema.Draft7Validator(schema.schema)
    errors = sorted(validator.iter_errors(obj), key=lambda error: list(error.absolute_path))
    if errors:
        error = errors[0]
        field = ".".join(str(part) for part in error.absolute_path) or "<root>"
        name = obj.get("metadata", {}).get("name", "?")
        raise ValueError(f"{kind} {name}: {field}: {error.message}")
