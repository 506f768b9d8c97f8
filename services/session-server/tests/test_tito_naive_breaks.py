"""The naive approach - re-render the whole history and re-encode it every turn - breaks the prefix invariant.

Each test plays one turn the way an engine does (prompt ids + sampled completion ids = stored ids), then builds
the next prompt naively and with TITO: the naive prompt does not start with the stored ids, TITO's does and
has no critical mismatch against a fresh render. So the conformance suite can fail, and TITO is why it passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from miles.session.tito import TitoTokenizer
from miles.session.tito.conformance import noncanonical_encode, simulate_completion

Messages = list[dict[str, Any]]
MakeTito = Callable[..., TitoTokenizer]
SYSTEM = {"role": "system", "content": "You are a helpful agent."}
USER = {"role": "user", "content": "What's the weather in Paris?"}


def _extends(prompt: Sequence[int], stored: Sequence[int]) -> bool:
    return list(prompt[: len(stored)]) == list(stored)


def _stored(tito: TitoTokenizer, history: Messages, completion_ids: list[int], tools: Messages, **kw: Any) -> list[int]:
    """Prompt ids of the first turn + the completion ids the engine sampled."""
    return [*tito.first_prompt(history, tools=tools, chat_template_kwargs=kw).prompt_ids, *completion_ids]


def _naive(tito: TitoTokenizer, messages: Messages, tools: Messages, **kw: Any) -> list[int]:
    return tito.encode_messages(messages, tools=tools, add_generation_prompt=True, chat_template_kwargs=kw)


def _tito_next(
    tito: TitoTokenizer, stored: list[int], previous: Messages, appended: Messages, tools: Messages, **kw: Any
) -> list[int]:
    prompt = tito.extend(stored, previous, appended, tools=tools, chat_template_kwargs=kw)
    assert _extends(prompt.prompt_ids, stored)
    fresh = _naive(tito, [*previous, *appended], tools, **kw)
    assert tito.comparator().compare(fresh, prompt.prompt_ids).num_critical == 0
    return prompt.prompt_ids


def test_naive_rerender_breaks_qwen3_loop_last_think_block(
    make_tito: MakeTito, weather_tools: Messages, weather_call: Callable[..., dict[str, Any]]
) -> None:
    """Qwen3 non-thinking: the vendor renders the empty think block only for the *last* assistant turn."""
    vendor, tito = make_tito("qwen3", fixed_template_file=None, template_kwargs={}), make_tito("qwen3")
    reply = {"role": "assistant", "content": "", "tool_calls": [weather_call()]}
    completion = simulate_completion(tito, [SYSTEM, USER], reply, weather_tools)
    stored = _stored(vendor, [SYSTEM, USER], vendor.codec.encode(completion), weather_tools, enable_thinking=False)
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}
    assert "<think>\n\n</think>" in vendor.codec.decode(stored)
    naive = _naive(vendor, [SYSTEM, USER, reply, tool], weather_tools, enable_thinking=False)
    assert not _extends(naive, stored)
    assert vendor.codec.decode(naive).count("<think>\n\n</think>") == 1  # only the new generation prompt's
    _tito_next(tito, stored, [SYSTEM, USER, reply], [tool], weather_tools, enable_thinking=False)


def test_naive_rerender_breaks_when_a_thinking_template_drops_reasoning(
    make_tito: MakeTito, weather_tools: Messages
) -> None:
    """Qwen3 thinking: the reasoning of turns before the last user query disappears from the re-render."""
    vendor, tito = make_tito("qwen3", fixed_template_file=None, template_kwargs={}), make_tito("qwen3")
    reply = {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Paris is usually mild."}
    completion = simulate_completion(tito, [SYSTEM, USER], reply, weather_tools)
    stored = _stored(vendor, [SYSTEM, USER], vendor.codec.encode(completion), weather_tools)
    follow_up = {"role": "user", "content": "And tomorrow?"}
    naive = _naive(vendor, [SYSTEM, USER, reply, follow_up], weather_tools)
    assert not _extends(naive, stored)
    assert "Paris is usually mild." not in vendor.codec.decode(naive)
    prompt_ids = _tito_next(tito, stored, [SYSTEM, USER, reply], [follow_up], weather_tools)
    assert "Paris is usually mild." in tito.codec.decode(prompt_ids)


def test_naive_rerender_breaks_glm47_reasoning_at_text_level(make_tito: MakeTito, weather_tools: Messages) -> None:
    vendor, tito = make_tito("glm-4.7", template_kwargs={}), make_tito("glm-4.7")
    reply = {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}
    completion = simulate_completion(tito, [SYSTEM, USER], reply, weather_tools)
    stored = _stored(vendor, [SYSTEM, USER], vendor.codec.encode(completion), weather_tools)
    follow_up = {"role": "user", "content": "Thanks!"}
    assert not _extends(_naive(vendor, [SYSTEM, USER, reply, follow_up], weather_tools), stored)
    _tito_next(tito, stored, [SYSTEM, USER, reply], [follow_up], weather_tools)


def test_naive_rerender_breaks_on_tool_call_json_reserialisation(make_tito: MakeTito, weather_tools: Messages) -> None:
    """The model wrote compact JSON with an escape; a re-render re-serialises the parsed arguments canonically."""
    tito = make_tito("qwen2.5")
    sampled = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Z\\u00fcrich"}}\n</tool_call><|im_end|>'
    stored = _stored(tito, [SYSTEM, USER], tito.codec.encode(sampled), weather_tools)
    reply = tito.parse_completion(sampled, tools=weather_tools).to_openai_message()
    assert reply["tool_calls"][0]["function"]["arguments"] == '{"city":"Z\\u00fcrich"}'
    tool = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "9 °C"}
    naive = _naive(tito, [SYSTEM, USER, reply, tool], weather_tools)
    assert not _extends(naive, stored)
    assert '{"city": "Zürich"}' in tito.codec.decode(naive)
    prompt = tito.extend(stored, [SYSTEM, USER, reply], [tool], tools=weather_tools)
    assert _extends(prompt.prompt_ids, stored)
    result = tito.comparator().compare(naive, prompt.prompt_ids)
    assert result.num_critical == 0
    assert result.counts == {"assistant_text": 1}  # what the model sampled is kept verbatim: not critical


def test_naive_reencoding_breaks_a_non_canonical_sampled_split(make_tito: MakeTito, weather_tools: Messages) -> None:
    """Even with an append-only template, re-encoding assistant text changes the ids the engine sampled."""
    tito = make_tito("qwen3")
    reply = {"role": "assistant", "content": "Hello there, the weather is lovely.", "reasoning_content": "Greet."}
    completion = simulate_completion(tito, [SYSTEM, USER], reply, weather_tools)
    sampled = noncanonical_encode(tito.codec, completion)
    assert sampled != tito.codec.encode(completion)
    stored = _stored(tito, [SYSTEM, USER], sampled, weather_tools)
    follow_up = {"role": "user", "content": "Great."}
    assert not _extends(_naive(tito, [SYSTEM, USER, reply, follow_up], weather_tools), stored)
    _tito_next(tito, stored, [SYSTEM, USER, reply], [follow_up], weather_tools)
