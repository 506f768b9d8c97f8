"""Rendering matches transformers; offline assets, codecs and the best-effort `default` family."""

from __future__ import annotations

import json
import logging

import pytest

from miles.session.tito import CharCodec, HFTokenizerCodec, TitoTokenizer, TokenizerUnavailableError, get_family
from miles.session.tito.assets import bundled_codec, bundled_tokenizer_dir, fixed_template, vendor_template
from miles.session.tito.render import compile_template, render_template

MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Call it.",
        "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "Report."},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> object:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(bundled_tokenizer_dir("qwen3") / "tokenizer.json"))


@pytest.mark.parametrize(
    ("template_id", "kwargs"),
    [
        ("Qwen/Qwen3-0.6B", {"enable_thinking": False}),
        ("qwen3_fixed.jinja", {"clear_thinking": False}),
        ("meta-llama-Llama-3.2-3B-Instruct", {"date_string": "26 Jul 2024"}),
    ],
)
def test_render_equals_transformers_apply_chat_template(
    hf_tokenizer: object, template_id: str, kwargs: dict[str, object]
) -> None:
    template = fixed_template(template_id) if template_id.endswith(".jinja") else vendor_template(template_id)
    single_call = [{k: v for k, v in m.items() if i != 2 or k != "reasoning_content"} for i, m in enumerate(MESSAGES)]
    expected = hf_tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        single_call, chat_template=template, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
    )
    ours = render_template(
        compile_template(template),
        single_call,
        tools=TOOLS,
        add_generation_prompt=True,
        bos_token="",
        eos_token="<|im_end|>",
        template_kwargs=kwargs,
    )
    assert ours == expected


def test_generation_blocks_render_their_body() -> None:
    template = compile_template(
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    )
    out = render_template(
        template,
        [{"content": "a"}],
        tools=None,
        add_generation_prompt=False,
        bos_token="",
        eos_token="",
        template_kwargs={},
    )
    assert out == "[a]"


def test_offline_assets_are_found_by_repo_id_and_fail_clearly() -> None:
    assert "<|im_start|>" in vendor_template("Qwen/Qwen3-0.6B")
    with pytest.raises(TokenizerUnavailableError, match="no vendor chat template for 'acme/none'"):
        vendor_template("acme/none")
    qwen25 = bundled_codec("qwen2.5")
    assert qwen25.token_id("<think>") is None and bundled_codec("qwen3").token_id("<think>") == 151667
    assert qwen25.encode("<|im_end|>") == [151645]


def test_codecs_round_trip_text_with_special_tokens() -> None:
    text = "<|im_start|>user\nZürich ☕ 東京\n\n<|im_end|>\n"
    codec = HFTokenizerCodec.from_file(bundled_tokenizer_dir("qwen3"))
    assert codec.decode(codec.encode(text)) == text
    chars = CharCodec(name="t", special_tokens=["<|im_start|>", "<|im_end|>"], added_tokens=["<think>"])
    ids = chars.encode(text + "<think>")
    assert chars.decode(ids) == text + "<think>"
    assert len(ids) == len(text) - len("<|im_start|>") - len("<|im_end|>") + 2 + 1
    assert chars.special_ids() == {chars.token_id("<|im_start|>"), chars.token_id("<|im_end|>")}


def test_long_texts_and_id_runs_take_the_gil_free_paths_with_the_same_result() -> None:
    """Past 16 characters / 4k ids the codec switches to `encode_batch_fast` / `decode_batch` (GIL released): the
    ids and text must be exactly what `encode` / `decode` give, special tokens and multi-byte characters included."""
    codec = HFTokenizerCodec.from_file(bundled_tokenizer_dir("qwen3"))
    tokenizer = codec._tokenizer
    pieces = ["the ", "\n\n", " ", "Zürich", "☕", "<|im_start|>", "  x", "\t", "12345", "東京", "'s", "<think>"]
    text = "".join(pieces[(i * 7 + i // 3) % len(pieces)] for i in range(12_000))
    assert len(text) > 16 * 1024
    ids = codec.encode(text)
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids and len(ids) > 4096
    assert codec.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False) == text


def test_default_family_reads_its_junction_off_the_template(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        tito = TitoTokenizer(
            get_family("default"), bundled_codec("qwen2.5"), chat_template=vendor_template("Qwen-Qwen2.5-7B-Instruct")
        )
    assert "best effort" in caplog.text
    assert tito.family.stop_tokens == ("<|im_end|>",) and tito.family.junction_text == "\n"
    assert tito.family.assistant_starts == ("<|im_start|>assistant",)


def test_default_family_falls_back_to_real_histories_when_the_base_cannot_render() -> None:
    """Qwen3.5's vendor template raises without a user message, so the synthetic base cannot render."""
    codec = CharCodec(name="c", special_tokens=["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>")
    tito = TitoTokenizer(get_family("default"), codec, chat_template=vendor_template("Qwen-Qwen3.5-0.8B"))
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    completion = "<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>"
    stored = codec.encode(tito.render(history[:1], add_generation_prompt=True) + completion)
    tool = {"role": "tool", "tool_call_id": "c0", "content": "ok"}
    prompt = tito.extend(stored, history, [tool])
    assert codec.decode(prompt.prompt_ids) == tito.render([*history, tool], add_generation_prompt=True)


def test_tool_arguments_render_as_sampled_for_string_families(qwen3: TitoTokenizer) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"b":1,"a":2}'}}
    text = qwen3.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert '"arguments": {"b":1,"a":2}}' in text
    assert json.loads('{"b":1,"a":2}') == {"b": 1, "a": 2}
