"""TokenSeqComparator classifies each kind of difference, and exports counts as metrics and metadata."""

from __future__ import annotations

import json

from miles.common.telemetry import Metrics
from miles.session.tito import MismatchKind, TitoTokenizer, register_tito_metrics

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue.", "reasoning_content": "Pick one."},
    {"role": "user", "content": "Another?"},
]


def _ids(qwen3: TitoTokenizer, text: str) -> list[int]:
    return qwen3.codec.encode(text)


def _kinds(qwen3: TitoTokenizer, expected: str, actual: str) -> list[str]:
    result = qwen3.comparator().compare(_ids(qwen3, expected), _ids(qwen3, actual))
    return [m.kind.value for m in result.mismatches]


def test_identical_sequences_and_trailing_newline_do_not_mismatch(qwen3: TitoTokenizer) -> None:
    text = qwen3.render(CONVERSATION)
    assert text.endswith("<|im_end|>\n")
    assert _kinds(qwen3, text, text) == []
    assert _kinds(qwen3, text, text.removesuffix("\n")) == []


def test_each_kind_is_classified(qwen3: TitoTokenizer) -> None:
    text = qwen3.render(CONVERSATION)
    assert _kinds(
        qwen3, text, text.replace("<|im_end|>\n<|im_start|>user\nAnother", "\n<|im_start|>user\nAnother")
    ) == ["special_token_count"]
    assert _kinds(qwen3, text, text.replace("<|im_start|>user\nAnother", "<|endoftext|>user\nAnother")) == [
        "special_token_type"
    ]
    assert _kinds(qwen3, text, text.replace("Another?", "Another!")) == ["non_assistant_text"]
    assert _kinds(qwen3, text, text.replace("Blue.", "Blue!")) == ["assistant_text"]
    assert not MismatchKind.ASSISTANT_TEXT.critical and not MismatchKind.ASSISTANT_SPECIAL.critical
    non_critical = (MismatchKind.ASSISTANT_TEXT, MismatchKind.ASSISTANT_SPECIAL)
    assert all(kind.critical for kind in MismatchKind if kind not in non_critical)


def test_a_boundary_token_the_engine_sampled_inside_a_completion_is_not_critical(qwen3: TitoTokenizer) -> None:
    """Seen in a demo run: the policy wrote `<|im_start|>` in the middle of a (truncated) answer after a tool call;
    a fresh render cannot align with it, yet the buffer is exactly what was sampled."""
    text = qwen3.render(CONVERSATION)
    completion_start = len(_ids(qwen3, text[: text.index("<think>")]))
    degenerate = text.replace("Blue.", "Blue<|im_start|>0")
    completion_end = len(_ids(qwen3, degenerate[: degenerate.index("<|im_end|>\n<|im_start|>user\nAnother")])) + 1
    comparator = qwen3.comparator()
    sampled = [(completion_start, completion_end)]
    result = comparator.compare(_ids(qwen3, text), _ids(qwen3, degenerate), sampled_spans=sampled)
    assert [m.kind for m in result.mismatches] == [MismatchKind.ASSISTANT_SPECIAL] and result.ok
    unsampled = comparator.compare(_ids(qwen3, text), _ids(qwen3, degenerate))
    assert [m.kind for m in unsampled.mismatches] == [MismatchKind.SPECIAL_TOKEN_COUNT] and not unsampled.ok
    the_stop_token_only = [(completion_start, completion_start + 1)]
    outside = comparator.compare(_ids(qwen3, text), _ids(qwen3, degenerate), sampled_spans=the_stop_token_only)
    assert not outside.ok, "a boundary outside the sampled tokens stays critical"


def test_a_different_tokenization_of_the_same_text_is_no_mismatch(qwen3: TitoTokenizer) -> None:
    text = qwen3.render(CONVERSATION)
    start = text.index("Blue.")
    split = _ids(qwen3, text[:start]) + _ids(qwen3, "Bl") + _ids(qwen3, "ue.") + _ids(qwen3, text[start + 5 :])
    assert split != _ids(qwen3, text)
    assert qwen3.comparator().compare(_ids(qwen3, text), split).mismatches == ()


def test_results_become_session_metadata_and_prometheus_counters(qwen3: TitoTokenizer) -> None:
    text = qwen3.render(CONVERSATION)
    result = qwen3.comparator().compare(_ids(qwen3, text), _ids(qwen3, text.replace("Blue.", "Red.")))
    metadata = result.to_metadata()
    assert json.loads(json.dumps(metadata)) == metadata
    assert metadata["mismatch_counts"] == {
        "special_token_count": 0,
        "special_token_type": 0,
        "non_assistant_text": 0,
        "assistant_text": 1,
        "assistant_special": 0,
    }
    assert metadata["num_critical"] == 0 and metadata["mismatches"][0]["expected_text"].endswith("Blue.")

    metrics = Metrics("session")
    tito_metrics = register_tito_metrics(metrics)
    tito_metrics.record(result)
    tito_metrics.record(qwen3.comparator().compare(_ids(qwen3, text), _ids(qwen3, text)))
    exposition = metrics.exposition().decode()
    assert 'miles_session_tito_mismatch_total{kind="assistant_text"} 1.0' in exposition
    assert 'miles_session_tito_mismatch_total{kind="special_token_count"} 0.0' in exposition
    assert 'miles_session_tito_comparisons_total{result="non_critical"} 1.0' in exposition
    assert 'miles_session_tito_comparisons_total{result="clean"} 1.0' in exposition
