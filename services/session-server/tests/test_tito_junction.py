"""Junction patches: how the stored completion meets the next turn, and what the sample builder is told."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles.session.tito import TitoTokenizer

SYSTEM = {"role": "system", "content": "sys"}
USER = {"role": "user", "content": "weather?"}
TOOL_CALL_COMPLETION = (
    "<think>\nr\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
)


def _qwen3_turn(qwen3: TitoTokenizer, call: dict[str, Any], completion: str) -> tuple[list[int], list[dict[str, Any]]]:
    reply = {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [call]}
    return [*qwen3.first_prompt([SYSTEM, USER]).prompt_ids, *qwen3.codec.encode(completion)], [SYSTEM, USER, reply]


def test_qwen3_appends_the_newline_the_template_puts_after_im_end(
    qwen3: TitoTokenizer, weather_call: Callable[..., dict[str, Any]]
) -> None:
    completion = TOOL_CALL_COMPLETION
    stored, previous = _qwen3_turn(qwen3, weather_call(), completion)
    prompt = qwen3.extend(stored, previous, [{"role": "tool", "tool_call_id": "call_0", "content": "sunny"}])
    assert prompt.num_trimmed_tokens == 0 and prompt.prompt_ids[: len(stored)] == stored
    assert prompt.appended_text.startswith("\n<|im_start|>user\n<tool_response>\nsunny")
    assert prompt.appended_ids[0] == qwen3.codec.encode("\n")[0]
    assert qwen3.max_trim_tokens == 0
    assert qwen3.trailing_token_ids == frozenset(qwen3.codec.encode("\n"))


def test_completion_cut_before_its_stop_token_gets_the_turn_closed(
    qwen3: TitoTokenizer, weather_call: Callable[..., dict[str, Any]]
) -> None:
    stored, previous = _qwen3_turn(qwen3, weather_call(), "<think>\nr\n</think>\n\nIt is")
    prompt = qwen3.extend(stored, previous, [{"role": "user", "content": "go on"}])
    assert prompt.prompt_ids[: len(stored)] == stored
    assert prompt.appended_text.startswith("<|im_end|>\n<|im_start|>user\ngo on")


def test_plain_concatenation_without_the_patch_is_a_critical_structure_mismatch(
    qwen3: TitoTokenizer, weather_call: Callable[..., dict[str, Any]]
) -> None:
    completion = TOOL_CALL_COMPLETION
    stored, previous = _qwen3_turn(qwen3, weather_call(), completion)
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}
    prompt = qwen3.extend(stored, previous, [tool])
    unpatched = stored + qwen3.codec.encode(prompt.appended_text[1:])
    fresh = qwen3.encode_messages([*previous, tool], add_generation_prompt=True)
    assert qwen3.comparator().compare(fresh, prompt.prompt_ids).mismatches == ()
    assert [m.kind.value for m in qwen3.comparator().compare(fresh, unpatched).mismatches] == ["special_token_count"]


def test_glm_drops_the_stop_token_that_is_also_the_next_opener(
    glm47: TitoTokenizer, weather_call: Callable[..., dict[str, Any]]
) -> None:
    """The engine stopped on <|observation|> after a tool call, but the next message is a user turn."""
    reply = {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [weather_call()]}
    prompt_text = glm47.render([SYSTEM, USER], add_generation_prompt=True)
    completion = "r</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    stored = glm47.codec.encode(prompt_text + completion + "<|observation|>")
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}
    prompt = glm47.extend(stored, [SYSTEM, USER, reply], [tool, {"role": "user", "content": "and now?"}])
    assert prompt.num_trimmed_tokens == 1 == glm47.max_trim_tokens
    assert prompt.prompt_ids[: len(stored) - 1] == stored[:-1]
    assert prompt.appended_text.startswith("<|observation|><tool_response>sunny</tool_response><|user|>and now?")
    ids = glm47.codec
    assert glm47.trailing_token_ids == {ids.token_id(t) for t in ("<|user|>", "<|observation|>", "<|endoftext|>")}


def test_first_prompt_reports_an_open_think_block(make_tito: Callable[..., TitoTokenizer]) -> None:
    tito = make_tito("qwen3-thinking-2507")
    prompt = tito.first_prompt([SYSTEM, USER])
    assert prompt.reasoning_open and prompt.appended_text.endswith("<|im_start|>assistant\n<think>\n")
    parsed = tito.parse_completion(tito.codec.encode("Hmm.\n</think>\n\nSunny.<|im_end|>"), reasoning_open=True)
    assert (parsed.reasoning_content, parsed.content) == ("Hmm.", "Sunny.")
    assert (
        not make_tito("qwen3")
        .first_prompt([SYSTEM, USER], chat_template_kwargs={"enable_thinking": False})
        .reasoning_open
    )


def test_real_history_mode_gives_the_same_prompt_as_the_synthetic_base(
    qwen3: TitoTokenizer, make_tito: Callable[..., TitoTokenizer], weather_call: Callable[..., dict[str, Any]]
) -> None:
    """The per-family exception for templates that fold turns: diff the real histories (costs O(history))."""
    stored, previous = _qwen3_turn(qwen3, weather_call(), TOOL_CALL_COMPLETION)
    appended = [{"role": "tool", "tool_call_id": "call_0", "content": "sunny"}, {"role": "user", "content": "ok?"}]
    real = make_tito("qwen3", render_real_history=True).extend(stored, previous, appended)
    assert real.prompt_ids == qwen3.extend(stored, previous, appended).prompt_ids
