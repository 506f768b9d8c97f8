"""The conformance suite passes for every family x role set, and fails for configurations known to be wrong."""

from __future__ import annotations

import dataclasses

from miles.session.tito import ROLE_SETS, family_names, get_family
from miles.session.tito.conformance import verify
from miles.session.tito.corpus import CORPUS


def test_every_family_and_role_set_has_zero_critical_mismatches() -> None:
    results = verify()
    failures = {(r.family, r.roles): r.totals.failures for r in results if r.num_critical}
    assert failures == {}
    expected_combos = {(name, roles) for name in family_names() for roles in get_family(name).role_sets}
    assert {(r.family, frozenset(r.roles)) for r in results} == expected_combos
    assert len(results) == 40
    assert all(r.num_conversations >= 6 and r.totals.num_turns > 0 for r in results)
    # The split pass really feeds non-canonical ids wherever a real BPE tokenizer is used.
    assert all(r.totals.noncanonical_turns > 0 for r in results if r.level == "token")


def test_corpus_covers_the_required_shapes() -> None:
    assert len(CORPUS) >= 20
    assert {frozenset({"tool"}), frozenset({"tool", "user"}), frozenset({"system", "tool"})} <= {
        c.appended_roles for c in CORPUS
    }
    assert max(c.max_tool_calls_per_turn for c in CORPUS) >= 3
    assert any(len(m.get("content") or "") > 10_000 for c in CORPUS for m in c.messages)


def test_suite_detects_vendor_templates_that_re_render_history() -> None:
    subset = [c for c in CORPUS if c.name in {"single_tool", "thinking_multi_user", "empty_content_and_output"}]
    qwen3_vendor = dataclasses.replace(get_family("qwen3"), fixed_template_file=None, template_kwargs={})
    glm45_vendor = dataclasses.replace(get_family("glm-4.5"), fixed_template_file=None)
    rows = verify([qwen3_vendor, glm45_vendor], [ROLE_SETS[1]], corpus=subset)
    assert [r.family for r in rows] == ["qwen3", "glm-4.5"]
    assert all(r.num_critical > 0 for r in rows)


def test_suite_detects_a_missing_junction_patch() -> None:
    subset = [c for c in CORPUS if c.name == "single_tool"]
    no_newline = dataclasses.replace(get_family("qwen3"), junction_text="")
    (row,) = verify([no_newline], [ROLE_SETS[0]], corpus=subset)
    assert row.num_critical > 0
