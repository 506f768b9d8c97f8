"""Every Markdown link of the repository resolves inside it, so a fresh clone has a working map (docs/README.md).

Checked over every Markdown file git knows (tracked, or new and not ignored): inline links and images
`[text](target)`, and reference definitions `[label]: target`. A relative target must exist inside the
repository (a path that escapes the root fails, and so does one git ignores: a fresh clone would not have it),
and a `#anchor` must name a heading of the target Markdown file, computed as GitHub computes it (lower case,
punctuation dropped except `-` and `_`, each space a `-`, `-1`, `-2` ... for repeated headings). Links with a
scheme (https:, mailto: ...) are not followed. No file may point at the design's old home outside the
repository either.

Limits: setext headings (underlined with === or ---) are not read (the repository uses `#` headings only);
link text spanning two lines is not matched; an anchor into a non-Markdown file (e.g. `#L10`) is not checked.
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {".git", ".venv", ".tools", ".miles", "node_modules", "build", "dist", ".hypothesis", "__pycache__"}
SKIPPED_DIRS |= {".mypy_cache", ".ruff_cache", ".pytest_cache"}
TEXT_SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".toml", ".tpl", ".gotmpl", ".proto", ".txt", ".cfg", ".ini"}
TEXT_NAMES = {"Makefile", "Dockerfile", "run"}
OLD_HOME = "../" + "shared/"  # spelled in two parts so that this file does not match itself

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*?(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_HTML_TAG = re.compile(r"<[^>]+>")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")


def repository_files() -> list[Path]:
    """Files git tracks plus new ones it does not ignore (what a commit of this tree would hold)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO_ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # no git (an unpacked archive): walk the tree instead
        return sorted(p for p in REPO_ROOT.rglob("*") if p.is_file() and not _skipped(p.relative_to(REPO_ROOT)))
    paths = {REPO_ROOT / name for name in listed.split("\0") if name}
    return sorted(p for p in paths if p.is_file())


def _skipped(relative: Path) -> bool:
    return any(part in SKIPPED_DIRS for part in relative.parts[:-1])


@cache
def known_paths() -> frozenset[Path]:
    """Every repository file and every directory holding one."""
    paths: set[Path] = set()
    for path in repository_files():
        paths.add(path)
        paths.update(parent for parent in path.parents if parent.is_relative_to(REPO_ROOT))
    return frozenset(paths)


def markdown_files() -> list[Path]:
    return [path for path in repository_files() if path.suffix == ".md"]


def outside_code(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    fence = ""
    for number, line in enumerate(lines, start=1):
        match = _FENCE.match(line)
        if fence:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = ""
            continue
        if match:
            fence = match.group(1)
            continue
        yield number, line


def heading_text(raw: str) -> str:
    """The text GitHub renders for a heading's Markdown: code spans literal, links as their text, no markup."""
    parts: list[str] = []
    position = 0
    for match in _CODE_SPAN.finditer(raw):
        parts.append(_plain(raw[position : match.start()]))
        parts.append(match.group(2).strip() if match.group(2).strip() else match.group(2))
        position = match.end()
    parts.append(_plain(raw[position:]))
    return "".join(parts)


def _plain(markdown: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)  # [text](url) -> text
    text = _HTML_TAG.sub("", text)
    return re.sub(r"(?<![\w\\])_{1,3}|_{1,3}(?![\w])", "", text)  # _emphasis_ (not snake_case) -> emphasis


def slug(text: str) -> str:
    """GitHub's anchor of a heading text (github-slugger): lower case, keep letters, digits, marks, `-` and `_`,
    each space becomes `-`."""
    kept = [
        char for char in text.lower() if char.isalnum() or char in "-_ " or unicodedata.category(char).startswith("M")
    ]
    return "".join(kept).replace(" ", "-")


@cache
def anchors_of(path: Path) -> frozenset[str]:
    """Every anchor a link may use into this Markdown file (duplicate headings get -1, -2 ...)."""
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for _, line in outside_code(path.read_text(encoding="utf-8").splitlines()):
        anchors.update(match.group(1) for match in _HTML_ANCHOR.finditer(line))
        heading = _ATX_HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading_text(heading.group(2) or ""))
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return frozenset(anchors)


def links_of(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition outside code."""
    for number, line in outside_code(path.read_text(encoding="utf-8").splitlines()):
        definition = _REFERENCE_DEFINITION.match(line)
        if definition:
            yield number, definition.group(1).strip("<>")
            continue
        without_code = _CODE_SPAN.sub(lambda match: " " * len(match.group(0)), line)
        for match in _INLINE_LINK.finditer(without_code):
            yield number, match.group(1).strip("<>")


def problem_with(source: Path, target: str) -> str | None:
    """Why `target`, linked from `source`, does not resolve inside the repository (None: it does)."""
    if _SCHEME.match(target):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part)
    if path_part.startswith("/"):
        resolved = (REPO_ROOT / path_part.lstrip("/")).resolve()
    elif path_part:
        resolved = (source.parent / path_part).resolve()
    else:
        resolved = source
    if not resolved.is_relative_to(REPO_ROOT):
        return "points outside the repository"
    if resolved not in known_paths():
        return "does not exist in the repository" if not resolved.exists() else "is ignored by git (not in a clone)"
    if not anchor:
        return None
    if resolved.is_dir():
        resolved = resolved / "README.md"
        if resolved not in known_paths():
            return None
    if resolved.suffix != ".md":
        return None
    if unquote(anchor) not in anchors_of(resolved):
        return f"has no heading with anchor #{anchor}"
    return None


def test_slug_follows_github() -> None:
    assert slug(heading_text("1. The loop")) == "1-the-loop"
    assert slug(heading_text("CLI (`miles`)")) == "cli-miles"
    assert slug(heading_text("Settings (`MILES_CONTROLLER_<FIELD>`)")) == "settings-miles_controller_field"
    assert slug(heading_text("Weight path — trainer → engines")) == "weight-path--trainer--engines"
    assert slug(heading_text("The [buffer](services/buffer/README.md) and _its_ leases")) == "the-buffer-and-its-leases"


@pytest.mark.integration  # git ls-files
def test_every_markdown_link_resolves_inside_the_repository() -> None:
    files = markdown_files()
    assert REPO_ROOT / "docs" / "README.md" in files, "docs/README.md (the map of docs/) is missing"
    broken = [
        f"{source.relative_to(REPO_ROOT)}:{number}: ({target}) {problem}"
        for source in files
        for number, target in links_of(source)
        if (problem := problem_with(source, target)) is not None
    ]
    assert not broken, f"{len(broken)} broken Markdown link(s):\n" + "\n".join(broken)


@pytest.mark.integration  # git ls-files
def test_nothing_points_at_the_old_design_home() -> None:
    offenders = []
    for path in repository_files():
        if path.suffix not in TEXT_SUFFIXES and path.name not in TEXT_NAMES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        offenders += [
            f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
            for number, line in enumerate(text.splitlines(), start=1)
            if OLD_HOME in line
        ]
    assert not offenders, f"the design lives in docs/ now; {len(offenders)} line(s) still point outside:\n" + "\n".join(
        offenders
    )
