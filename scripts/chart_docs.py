"""Generate helm/miles/README.md from README.md.gotmpl and the `# --` comments of values.yaml (`make chart-docs`).

Every key of values.yaml that carries a `# -- <description>` comment (continued by the `# ...` lines right below
it) becomes a row of the values table: dotted key, type, default (as in values.yaml; long defaults are shortened,
values.yaml has them in full) and description. The hand-written part of the README lives in README.md.gotmpl
(excluded from the packaged chart by .helmignore); its `{{ values_table }}` line is replaced by the table.
`--check` exits 1 when README.md is not what this script would write (a chart test runs it).

Limits: a line-based reader of this values.yaml's style (block mappings indented by two spaces, flow-style
values on one line); it is not a general YAML comment parser.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CHART_DIR = Path(__file__).resolve().parents[1] / "helm" / "miles"
TABLE_MARKER = "{{ values_table }}"
MAX_DEFAULT_CHARS = 80
_KEY_RE = re.compile(r"^(?P<indent> *)(?P<key>[^\s#:][^:]*?):(?:\s|$)")
_DOC_RE = re.compile(r"^(?P<indent> *)# -- (?P<text>.*)$")
_CONTINUATION_RE = re.compile(r"^(?P<indent> *)#(?: (?P<text>.*))?$")


@dataclass(frozen=True)
class ValueDoc:
    key: str
    type_name: str
    default: str
    description: str


def _type_name(value: Any) -> str:
    for python_type, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "string"), (list, "list")):
        if isinstance(value, python_type):
            return name
    return "object" if isinstance(value, dict) else "null"


def _default_text(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= MAX_DEFAULT_CHARS else text[: MAX_DEFAULT_CHARS - 1] + "…"


def _lookup(values: Any, path: list[str]) -> Any:
    for key in path:
        values = values[key]
    return values


def value_docs(values_text: str) -> list[ValueDoc]:
    """Every documented key of a values.yaml text, in file order."""
    values = yaml.safe_load(values_text)
    docs: list[ValueDoc] = []
    stack: list[tuple[int, str]] = []
    pending: list[str] | None = None
    for line in values_text.splitlines():
        doc = _DOC_RE.match(line)
        if doc:
            pending = [doc.group("text")]
            continue
        continuation = _CONTINUATION_RE.match(line)
        if continuation:
            if pending is not None and not line.strip().startswith(("# BEGIN", "# END")):
                pending.append(continuation.group("text") or "")
            continue
        key = _KEY_RE.match(line)
        if key is None or line.lstrip().startswith("- "):
            pending = None
            continue
        indent = len(key.group("indent"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [name for _, name in stack] + [key.group("key").strip("'\"")]
        stack.append((indent, path[-1]))
        if pending is not None:
            value = _lookup(values, path)
            description = " ".join(" ".join(pending).split())
            docs.append(ValueDoc(".".join(path), _type_name(value), _default_text(value), description))
            pending = None
    return docs


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def values_table(docs: list[ValueDoc]) -> str:
    rows = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for doc in docs:
        rows.append(f"| `{doc.key}` | {doc.type_name} | `{_cell(doc.default)}` | {_cell(doc.description)} |")
    return "\n".join(rows)


def render_readme(chart_dir: Path = CHART_DIR) -> str:
    template = (chart_dir / "README.md.gotmpl").read_text()
    if TABLE_MARKER not in template:
        raise ValueError(f"{chart_dir / 'README.md.gotmpl'} has no {TABLE_MARKER} line")
    table = values_table(value_docs((chart_dir / "values.yaml").read_text()))
    return template.replace(TABLE_MARKER, table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is not up to date")
    args = parser.parse_args()
    readme = CHART_DIR / "README.md"
    expected = render_readme()
    if args.check:
        if not readme.exists() or readme.read_text() != expected:
            print("helm/miles/README.md is out of date: run make chart-docs")
            return 1
        return 0
    readme.write_text(expected)
    return 0


if __name__ == "__main__":
    sys.exit(main())
