"""`miles-tito`: list the TITO families and run the conformance suite.

    miles-tito families
    miles-tito verify --all [--json]
    miles-tito verify --family qwen3 --family glm-4.7 --roles tool,user [--split-special-tokens]

`verify` prints one row per (family, role set) and ends with `critical_mismatches=<n> combos=<m>`; the exit
code is 1 when n > 0 (2 when nothing ran). It needs the offline assets of `make setup` and no network.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from miles.session.tito.families import ROLE_SETS, family_names, get_family, roles_label

_COLUMNS = (
    "family",
    "roles",
    "level",
    "convs",
    "turns",
    "prefix",
    "critical",
    "asst_text",
    "text",
    "parse",
    "errors",
    "noncanon",
    "total",
)


def _parse_roles(value: str) -> frozenset[str]:
    roles = frozenset(part.strip() for part in value.split(",") if part.strip())
    if roles not in ROLE_SETS:
        choices = " | ".join(roles_label(r) for r in ROLE_SETS)
        raise argparse.ArgumentTypeError(f"--roles must be one of {choices}")
    return roles


def _cmd_families() -> int:
    for name in family_names():
        family = get_family(name)
        sets = " ".join("{" + roles_label(r) + "}" for r in family.role_sets)
        level = "token" if family.tokenizer_asset else "text"
        print(f"{name:<22} {level:<6} {sets:<40} {family.description}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from miles.session.tito.conformance import verify

    if not args.all and not args.family:
        print("miles-tito verify: pass --all or --family NAME", file=sys.stderr)
        return 2
    names = family_names() if args.all else args.family
    for name in names:
        family = get_family(name)
        if args.roles is not None and not args.roles <= family.allowed_append_roles:
            print(f"# {name}: no {{{roles_label(args.roles)}}} combo: {family.notes}", file=sys.stderr)
    roles = [args.roles] if args.roles is not None else None
    results = verify(names, roles, split_special_tokens=args.split_special_tokens)
    total = sum(r.num_critical for r in results)
    if args.json:
        print(
            json.dumps(
                {"combos": [r.to_dict() for r in results], "critical_mismatches": total, "num_combos": len(results)},
                indent=2,
                ensure_ascii=False,
            )
        )
    else:
        print(" ".join(f"{c:<{w}}" for c, w in zip(_COLUMNS, _widths(), strict=True)))
        for r in results:
            t = r.totals
            cells = (
                r.family,
                ",".join(r.roles),
                r.level,
                r.num_conversations,
                t.num_turns,
                t.prefix_violations,
                t.critical_mismatches,
                t.assistant_text_mismatches,
                t.text_mismatches,
                t.parse_failures,
                t.errors,
                t.noncanonical_turns,
                r.num_critical,
            )
            print(" ".join(f"{c!s:<{w}}" for c, w in zip(cells, _widths(), strict=True)))
            for failure in t.failures:
                print(f"    ! {failure}")
        print(f"critical_mismatches={total} combos={len(results)}")
    if not results:
        return 2
    return 1 if total else 0


def _widths() -> tuple[int, ...]:
    return (20, 17, 5, 5, 5, 6, 8, 9, 4, 5, 6, 8, 5)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-tito", description="TITO families and conformance suite")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("families", help="list the registered families and their append role sets")
    verify_parser = sub.add_parser("verify", help="run the conformance suite")
    verify_parser.add_argument("--family", action="append", choices=family_names(), help="repeatable")
    verify_parser.add_argument("--all", action="store_true", help="every family")
    verify_parser.add_argument("--roles", type=_parse_roles, help="one role set, e.g. tool,user")
    verify_parser.add_argument("--json", action="store_true", help="print a JSON report instead of the table")
    verify_parser.add_argument(
        "--split-special-tokens",
        action="store_true",
        help="token strings in user/system/tool text encoded as plain text (the job option of that name)",
    )
    args = parser.parse_args(argv)
    # The `default` family warns that it is best effort; in a verification run that is expected noise.
    logging.basicConfig(level=logging.ERROR)
    code = _cmd_families() if args.command == "families" else _cmd_verify(args)
    sys.exit(code)
