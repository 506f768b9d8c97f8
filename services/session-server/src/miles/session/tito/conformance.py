"""The TITO conformance suite: simulate an engine over the corpus and check every turn of every family.

For each family, each of its chat-template variants (e.g. thinking on/off) and each corpus conversation whose
appended roles fit, it plays the conversation as a session would: the first prompt is a full render; each
generated assistant turn is "sampled" as the text the template renders for it, cut at the engine's stop token,
encoded canonically (pass `canonical`) or deliberately split mid-word (`Hel`+`lo`, pass `split`); the
completion is parsed back into an OpenAI message (which must re-render identically); the next prompt is built
with TITO from the stored ids and only the appended messages. Checked per turn:
(a) the prefix invariant, bit for bit (except the family's declared trim);
(b) 0 critical comparator mismatches against a fresh full render's ids;
(c) the decoded prompt equals the full render's text, and the appended text is its tail;
and at the end the whole session against a fresh render. A conversation is simulated once per (family,
variant, pass); rows for role sets reuse those runs (one template serves all of a family's role sets).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles.common.errors import MilesError
from miles.session.tito import assets
from miles.session.tito.codec import TokenCodec
from miles.session.tito.corpus import CORPUS, INJECTED_KEY, Conversation
from miles.session.tito.families import APPEND_ROLES, Family, Junction, Variant, family_names, get_family
from miles.session.tito.family_table import DEFAULT_VERIFY_TEMPLATE_ID
from miles.session.tito.prompt import TitoPrompt
from miles.session.tito.tokenizer import TitoTokenizer

PASSES: tuple[str, ...] = ("canonical", "split")
_DEFAULT_REASONING = "Let me think about this."
_MAX_LISTED_FAILURES = 5


class SimulationError(Exception):
    """The template cannot produce a consistent engine completion for a turn."""


@dataclass
class ConversationOutcome:
    """Counts for one conversation under one (variant, pass)."""

    num_turns: int = 0
    prefix_violations: int = 0
    critical_mismatches: int = 0
    assistant_text_mismatches: int = 0
    text_mismatches: int = 0
    parse_failures: int = 0
    errors: int = 0
    noncanonical_turns: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def num_critical(self) -> int:
        return (
            self.prefix_violations + self.critical_mismatches + self.text_mismatches + self.parse_failures + self.errors
        )

    def fail(self, counter: str, message: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        if len(self.failures) < _MAX_LISTED_FAILURES:
            self.failures.append(message)


@dataclass
class ComboResult:
    """One row: a family under one append role set, summed over variants, conversations and passes."""

    family: str
    roles: tuple[str, ...]
    level: str
    num_conversations: int = 0
    num_skipped: int = 0
    totals: ConversationOutcome = field(default_factory=ConversationOutcome)

    def add(self, outcome: ConversationOutcome, label: str) -> None:
        for name in (
            "num_turns",
            "prefix_violations",
            "critical_mismatches",
            "assistant_text_mismatches",
            "text_mismatches",
            "parse_failures",
            "errors",
            "noncanonical_turns",
        ):
            setattr(self.totals, name, getattr(self.totals, name) + getattr(outcome, name))
        for failure in outcome.failures:
            if len(self.totals.failures) < _MAX_LISTED_FAILURES:
                self.totals.failures.append(f"{label}: {failure}")

    @property
    def num_critical(self) -> int:
        return self.totals.num_critical

    def to_dict(self) -> dict[str, Any]:
        t = self.totals
        return {
            "family": self.family,
            "roles": list(self.roles),
            "level": self.level,
            "conversations": self.num_conversations,
            "skipped": self.num_skipped,
            "turns": t.num_turns,
            "prefix_violations": t.prefix_violations,
            "critical_mismatches": t.critical_mismatches,
            "assistant_text_mismatches": t.assistant_text_mismatches,
            "text_mismatches": t.text_mismatches,
            "parse_failures": t.parse_failures,
            "errors": t.errors,
            "noncanonical_turns": t.noncanonical_turns,
            "critical_total": self.num_critical,
            "failures": t.failures,
        }


@functools.lru_cache(maxsize=16)
def _pattern_of(tokens: tuple[str, ...]) -> re.Pattern[str] | None:
    ordered = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None


def _added_token_pattern(codec: TokenCodec) -> re.Pattern[str] | None:
    return _pattern_of(tuple(codec.added_token_strings()))


def noncanonical_encode(codec: TokenCodec, text: str) -> list[int]:
    """Encode `text` the way an engine might sample it: every plain-text run split in two (`Hel` + `lo`)."""
    pattern = _added_token_pattern(codec)
    pieces = pattern.split(text) if pattern is not None else [text]
    tokens = pattern.findall(text) if pattern is not None else []
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        middle = len(piece) // 2
        ids += codec.encode(piece[:middle]) + codec.encode(piece[middle:]) if middle else codec.encode(piece)
        if i < len(tokens):
            ids += codec.encode(tokens[i])
    return ids


def build_tokenizer(
    family: Family, variant: Variant | None = None, *, split_special_tokens: bool = False
) -> TitoTokenizer:
    """The TITO tokenizer the suite verifies `family` with (its bundled tokenizer or a CharCodec)."""
    template = assets.vendor_template(DEFAULT_VERIFY_TEMPLATE_ID) if family.name == "default" else None
    kwargs = dict(variant.kwargs) if variant is not None else None
    return TitoTokenizer(
        family,
        assets.verification_codec(family),
        chat_template=template,
        chat_template_kwargs=kwargs,
        split_special_tokens=split_special_tokens,
    )


def prepare_messages(conversation: Conversation, family: Family, variant: Variant) -> list[dict[str, Any]]:
    """The conversation as this family/variant's model would have it (reasoning on/off, Kimi-style ids)."""
    thinking = family.reasoning and variant.thinking
    renamed: dict[str, str] = {}
    messages: list[dict[str, Any]] = []
    for message in conversation.messages:
        m = {k: v for k, v in message.items() if k != INJECTED_KEY}
        if m["role"] == "assistant":
            m.pop("reasoning_content", None)
            if thinking and not message.get(INJECTED_KEY):
                m["reasoning_content"] = message.get("reasoning_content") or _DEFAULT_REASONING
            if family.tool_call_ids_name_calls and m.get("tool_calls"):
                calls = []
                for call in m["tool_calls"]:
                    renamed[call["id"]] = f"functions.{call['function']['name']}:{len(renamed)}"
                    calls.append({**call, "id": renamed[call["id"]]})
                m["tool_calls"] = calls
        if m["role"] == "tool" and m.get("tool_call_id") in renamed:
            m["tool_call_id"] = renamed[m["tool_call_id"]]
        messages.append(m)
    return messages


def simulate_completion(
    tito: TitoTokenizer, history: Sequence[Mapping[str, Any]], message: Mapping[str, Any], tools: Any
) -> str:
    """The text an engine emits for `message` after the prompt of `history`, up to and including its stop."""
    prompt_text = tito.render(history, tools=tools, add_generation_prompt=True)
    full_text = tito.render([*history, message], tools=tools)
    if not full_text.startswith(prompt_text):
        raise SimulationError(
            "the template renders this assistant turn differently from its generation prompt: "
            f"{prompt_text[-40:]!r} vs {full_text[len(prompt_text) - 40 : len(prompt_text)]!r}"
        )
    turn = full_text[len(prompt_text) :]
    family = tito.family
    if family.junction is Junction.STOP_IS_NEXT_OPENER:
        return turn + family.stop_token_after(bool(message.get("tool_calls")))
    body = turn.removesuffix(family.junction_text) if family.junction_text else turn
    if not any(body.endswith(stop) for stop in family.stop_tokens):
        raise SimulationError(f"the rendered assistant turn does not end with a stop token: {turn[-40:]!r}")
    return body


def _check_prompt(
    tito: TitoTokenizer,
    outcome: ConversationOutcome,
    stored: Sequence[int],
    prompt: TitoPrompt,
    history: Sequence[Mapping[str, Any]],
    tools: Any,
    where: str,
) -> None:
    kept = len(stored) - prompt.num_trimmed_tokens
    if prompt.num_trimmed_tokens > tito.max_trim_tokens or list(prompt.prompt_ids[:kept]) != list(stored[:kept]):
        outcome.fail("prefix_violations", f"{where}: the prompt does not extend the stored ids")
    expected_text = tito.render(history, tools=tools, add_generation_prompt=True)
    expected_ids = tito.encode_messages(history, tools=tools, add_generation_prompt=True)
    result = tito.comparator().compare(expected_ids, prompt.prompt_ids)
    critical = [m for m in result.mismatches if m.kind.critical]
    if critical:
        outcome.critical_mismatches += len(critical)
        if len(outcome.failures) < _MAX_LISTED_FAILURES:
            outcome.failures.append(f"{where}: {critical[0].kind.value} {critical[0].detail}")
    outcome.assistant_text_mismatches += len(result.mismatches) - len(critical)
    if tito.codec.decode(prompt.prompt_ids) != expected_text or not expected_text.endswith(prompt.appended_text):
        outcome.fail("text_mismatches", f"{where}: the prompt text differs from the full render")


def run_conversation(
    tito: TitoTokenizer, conversation: Conversation, variant: Variant, split: bool
) -> ConversationOutcome:
    """Play one conversation through TITO (see module docstring); never raises for a TITO failure."""
    outcome = ConversationOutcome()
    messages = prepare_messages(conversation, tito.family, variant)
    tools = list(conversation.tools) or None
    generated = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant" and not m.get(INJECTED_KEY)]
    history: list[dict[str, Any]] = list(messages[: generated[0]])
    try:
        prompt = tito.first_prompt(history, tools=tools)
        for turn, index in enumerate(generated):
            where = f"{conversation.name} turn {turn}"
            completion = simulate_completion(tito, history, messages[index], tools)
            canonical = tito.codec.encode(completion)
            completion_ids = noncanonical_encode(tito.codec, completion) if split else canonical
            outcome.noncanonical_turns += completion_ids != canonical
            reply = _parse_round_trip(tito, outcome, history, messages[index], completion_ids, prompt, tools, where)
            stored = [*prompt.prompt_ids, *completion_ids]
            history.append(reply)
            outcome.num_turns += 1
            if turn + 1 == len(generated):
                final = tito.comparator().compare(tito.encode_messages(history, tools=tools), stored)
                outcome.critical_mismatches += final.num_critical
                if final.num_critical and len(outcome.failures) < _MAX_LISTED_FAILURES:
                    outcome.failures.append(f"{where} (final): {final.mismatches[0].kind.value}")
                break
            appended = messages[index + 1 : generated[turn + 1]]
            prompt = tito.extend(stored, history, appended, tools=tools)
            history.extend(appended)
            _check_prompt(tito, outcome, stored, prompt, history, tools, where)
    except (SimulationError, MilesError) as exc:
        outcome.fail("errors", f"{conversation.name}: {type(exc).__name__}: {exc}")
    return outcome


def _parse_round_trip(
    tito: TitoTokenizer,
    outcome: ConversationOutcome,
    history: Sequence[Mapping[str, Any]],
    original: dict[str, Any],
    completion_ids: Sequence[int],
    prompt: TitoPrompt,
    tools: Any,
    where: str,
) -> dict[str, Any]:
    """The parsed reply (what the agent gets back); a parse that does not re-render identically is a failure."""
    parsed = tito.parse_completion(completion_ids, reasoning_open=prompt.reasoning_open, tools=tools)
    reply = parsed.to_openai_message()
    if tito.render([*history, reply], tools=tools) != tito.render([*history, original], tools=tools):
        outcome.fail("parse_failures", f"{where}: the parsed reply renders differently: {reply!r}")
        return original
    return reply


def _applicable(conversation: Conversation, family: Family, roles: frozenset[str]) -> bool:
    if not conversation.appended_roles <= roles:
        return False
    limit = family.max_tool_calls_per_turn
    return limit is None or conversation.max_tool_calls_per_turn <= limit


def verify(
    families: Iterable[str | Family] | None = None,
    role_sets: Iterable[frozenset[str]] | None = None,
    corpus: Sequence[Conversation] = CORPUS,
    *,
    split_special_tokens: bool = False,
) -> list[ComboResult]:
    """Verify families (names or `Family` objects; all registered by default) under role sets (each family's
    own by default): one row per (family, role set). `split_special_tokens`: the session option of that name."""
    results: list[ComboResult] = []
    for name_or_family in families or family_names():
        family = get_family(name_or_family) if isinstance(name_or_family, str) else name_or_family
        wanted = list(role_sets) if role_sets is not None else list(family.role_sets)
        combos = [roles for roles in wanted if roles <= family.allowed_append_roles]
        runs: dict[tuple[str, str, str], ConversationOutcome] = {}
        level = "token" if family.tokenizer_asset else "text"
        tokenizers = {
            variant.name: build_tokenizer(family, variant, split_special_tokens=split_special_tokens)
            for variant in family.variants
        }
        for roles in combos:
            row = ComboResult(family.name, tuple(r for r in APPEND_ROLES if r in roles), level)
            for conversation in corpus:
                if not _applicable(conversation, family, roles):
                    row.num_skipped += 1
                    continue
                row.num_conversations += 1
                for variant in family.variants:
                    for pass_name in PASSES:
                        key = (conversation.name, variant.name, pass_name)
                        if key not in runs:
                            tito = tokenizers[variant.name]
                            runs[key] = run_conversation(tito, conversation, variant, pass_name == "split")
                        row.add(runs[key], f"{variant.name}/{pass_name}")
            results.append(row)
    return results
