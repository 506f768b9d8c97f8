"""OpenAI wire shapes of a turn: sampling params in, a chat.completion out (streamed chunks: streaming.py)."""

from __future__ import annotations

from dataclasses import dataclass

from miles.session.api_models import ChatCompletionRequest
from miles.session.records import FinishType, Json
from miles.session.tito import ParsedCompletion

_REQUEST_TO_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "seed": "sampling_seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
}


@dataclass(frozen=True)
class CompletionBudget:
    """How many tokens a turn may generate: what was asked, and the limit it ran with."""

    max_new_tokens: int | None
    """Sent as sampling_params.max_new_tokens; None: nothing known limits it (no context length, no cap)."""
    requested: int | None
    """The request's max_tokens / max_completion_tokens (the smaller), else the sampling default's."""

    @property
    def clamped_from(self) -> int | None:
        """The asked-for value when it was larger than the limit (and clamped), else None."""
        if self.requested is None or self.max_new_tokens is None or self.requested <= self.max_new_tokens:
            return None
        return self.requested


def completion_budget(
    defaults: Json,
    request: ChatCompletionRequest,
    *,
    num_prompt_tokens: int,
    max_context_tokens: int | None,
    max_new_tokens_cap: int | None,
) -> CompletionBudget:
    """The one rule: the limit is context - prompt - 1 (an engine refuses prompt + max_new >= context), capped by
    the job's max_new_tokens; a request without max_tokens gets the limit, a larger ask is clamped to it. The
    caller refuses a prompt that leaves a limit below 1."""
    asked = [n for n in (request.max_tokens, request.max_completion_tokens) if n is not None]
    default = defaults.get("max_new_tokens")
    requested = min(asked) if asked else (int(default) if default is not None else None)
    room = None if max_context_tokens is None else max_context_tokens - num_prompt_tokens - 1
    limits = [n for n in (room, max_new_tokens_cap) if n is not None]
    limit = min(limits) if limits else None
    if requested is None:
        return CompletionBudget(limit, None)
    return CompletionBudget(requested if limit is None else min(requested, limit), requested)


def sampling_params(
    defaults: Json, request: ChatCompletionRequest, *, stop_token_ids: frozenset[int], budget: CompletionBudget
) -> Json:
    """SGLang sampling_params: session defaults < request fields; the family's stop ids always stop generation;
    max_new_tokens is the budget's."""
    params = dict(defaults)
    for openai_name, sglang_name in _REQUEST_TO_SAMPLING.items():
        value = getattr(request, openai_name)
        if value is not None:
            params[sglang_name] = value
    params.pop("max_new_tokens", None)
    if budget.max_new_tokens is not None:
        params["max_new_tokens"] = budget.max_new_tokens
    params["stop_token_ids"] = sorted(set(params.get("stop_token_ids") or ()) | stop_token_ids)
    return params


def budget_headers(body: Json) -> dict[str, str]:
    """Response headers of a `chat.completion` body reporting its completion limit and a clamped ask."""
    miles: Json = body["miles"]
    headers = {}
    if miles.get("max_new_tokens") is not None:
        headers["x-miles-max-new-tokens"] = str(miles["max_new_tokens"])
    if miles.get("max_tokens_clamped_from") is not None:
        headers["x-miles-max-tokens-clamped-from"] = str(miles["max_tokens_clamped_from"])
    return headers


def assistant_message(parsed: ParsedCompletion, turn_index: int) -> Json:
    """The OpenAI assistant message; tool calls without an id in the text get `call_<turn>_<i>` (deterministic,
    so every replica answers the same)."""
    message = parsed.to_openai_message()
    for index, (call, parsed_call) in enumerate(zip(message.get("tool_calls", []), parsed.tool_calls, strict=True)):
        if parsed_call.id is None:
            call["id"] = f"call_{turn_index}_{index}"
    return message


def finish_reason(message: Json, finish_type: FinishType) -> str:
    if message.get("tool_calls"):
        return "tool_calls"
    return "length" if finish_type is FinishType.LENGTH else "stop"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> Json:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def completion_body(
    *, completion_id: str, created: int, model: str, message: Json, finish: str, usage_body: Json, miles: Json
) -> Json:
    """A `chat.completion` object; `miles` carries session facts (turn index, recorded or not, weight version)."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage_body,
        "miles": miles,
    }
