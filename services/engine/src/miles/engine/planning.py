"""Turning one /generate body into the list of sequences to run, validated the way SGLang validates it.

Batch rules (SGLang's `GenerateReqInput`): `text` str / `input_ids` list of ints is one prompt, a list of them a
batch; scalar options apply to every item, lists must have the batch length; a string rid becomes
`rid_0 .. rid_{N-1}` for a batch; `n > 1` turns each prompt into n samples with fresh uuid rids, flattened
prompt-major, after a prefill-only warm-up of the prompt. `return_routed_experts` and `routed_experts_start_len`
apply to every item. `lora_path` (an adapter name, or one per item, null = the base model) is resolved to the
loaded adapter's id, which joins `extra_key` in the sequence's cache namespace (adapters.lora_namespace). Every
error raises BadRequestError with SGLang's message where SGLang has one.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from miles.engine.adapters import LORA_NOT_ENABLED, AdapterHold, lora_namespace
from miles.engine.errors import BadRequestError
from miles.engine.protocol import GenerateRequest
from miles.engine.radix_cache import CacheNamespace
from miles.engine.requests import LogprobOptions, SamplingParams
from miles.engine.tokenizer import TextTokenizer

T = TypeVar("T")


@dataclass(frozen=True)
class PlannedSequence:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    logprobs: LogprobOptions
    max_new_tokens: int
    namespace: CacheNamespace
    routed_experts_start_len: int | None = None
    """Return the routing of positions [this, seqlen - 1) (None: not asked for, or the engine does not record it)."""
    lora_id: str | None = None
    """The loaded LoRA adapter to run with (None: the base model)."""


@dataclass(frozen=True)
class GeneratePlan:
    sequences: list[PlannedSequence]
    is_batch: bool
    stream: bool
    return_prompt_token_ids: bool
    warmup_prompts: list[tuple[list[int], CacheNamespace, str | None]]
    """(prompt, namespace, lora_id) to prefill once before n > 1 samples."""
    adapter_hold: AdapterHold | None = field(default=None, compare=False)
    """The adapters the plan resolved, kept from unloading until its sequences are submitted (Engine.plan)."""

    def release_adapters(self) -> None:
        if self.adapter_hold is not None:
            self.adapter_hold.release()


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_length: int
    max_total_tokens: int
    max_sequences_per_request: int
    """Most sequences (prompts x n) one request may ask for: the engine's max_running_requests. A miles bound
    (SGLang has none): without it one request could make the engine plan millions of sequences."""
    return_routed_experts: bool = False
    """--enable-return-routed-experts: requests asking for routed experts get them (else they are served without)."""


def plan_generate(
    request: GenerateRequest,
    tokenizer: TextTokenizer,
    limits: Limits,
    resolve_lora: Callable[[str], str] | None = None,
) -> GeneratePlan:
    """`resolve_lora` maps an adapter name to its loaded id (raising BadRequestError); None: LoRA is off."""
    _refuse_unsupported(request)
    prompts, is_batch = _prompts(request, tokenizer, limits.max_sequences_per_request)
    size = len(prompts)
    sampling_raw = _per_item(request.sampling_params, size, "sampling_params")
    samplings = [SamplingParams.from_dict(raw) for raw in sampling_raw]
    num_samples = samplings[0].n
    if any(s.n != num_samples for s in samplings):
        raise BadRequestError("The parallel sample size n must be the same for every item of a batch.")
    _check_num_sequences(size * num_samples, limits.max_sequences_per_request)
    options = _logprob_options(request, size, limits.vocab_size)
    lora_ids = [_lora_id(name, resolve_lora) for name in _per_item(request.lora_path, size, "lora_path")]
    extra_keys = _per_item(request.extra_key, size, "extra_key")
    namespaces = [lora_namespace(lora_id, key) for lora_id, key in zip(lora_ids, extra_keys, strict=True)]
    rids = _rids(request.rid, size, is_batch)
    sequences: list[PlannedSequence] = []
    for index, prompt in enumerate(prompts):
        _check_prompt(prompt, options[index], limits)
        max_new = _max_new_tokens(samplings[index], len(prompt), limits)
        routing_start = _routed_experts_start(request, len(prompt), limits)
        for _ in range(num_samples):
            rid = rids[index] if num_samples == 1 else uuid.uuid4().hex
            sequences.append(
                PlannedSequence(
                    rid,
                    prompt,
                    samplings[index],
                    options[index],
                    max_new,
                    namespaces[index],
                    routing_start,
                    lora_ids[index],
                )
            )
    for params in samplings:
        for pattern in params.stop_regex:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise BadRequestError(f"invalid stop_regex {pattern!r}: {exc}") from exc
    warmups = [(p, namespaces[i], lora_ids[i]) for i, p in enumerate(prompts)] if num_samples > 1 else []
    is_list = is_batch or num_samples > 1
    return GeneratePlan(sequences, is_list, request.stream, request.return_prompt_token_ids, warmups)


def _refuse_unsupported(request: GenerateRequest) -> None:
    if request.input_embeds is not None:
        raise BadRequestError("input_embeds is not supported by miles-engine")
    if request.session_params is not None:
        raise BadRequestError("session_params is not supported by miles-engine")
    for name in ("image_data", "video_data", "audio_data"):
        if getattr(request, name) is not None:
            raise BadRequestError(f"{name} is not supported by miles-engine")


def _lora_id(name: Any, resolve_lora: Callable[[str], str] | None) -> str | None:
    if name is None:
        return None
    if resolve_lora is None:
        raise BadRequestError(LORA_NOT_ENABLED)
    return resolve_lora(str(name))


def _prompts(request: GenerateRequest, tokenizer: TextTokenizer, max_prompts: int) -> tuple[list[list[int]], bool]:
    if request.input_ids is not None:
        ids = request.input_ids
        if not ids:
            raise BadRequestError("input_ids cannot be empty.")
        if isinstance(ids[0], list):
            _check_num_sequences(len(ids), max_prompts)
            return [list(row) for row in ids if isinstance(row, list)], True
        return [[int(t) for t in ids if isinstance(t, int)]], False
    if request.text is not None:
        if isinstance(request.text, str):
            return [tokenizer.encode(request.text)], False
        if not request.text:
            raise BadRequestError("text cannot be an empty list.")
        _check_num_sequences(len(request.text), max_prompts)  # before tokenizing them all
        return [tokenizer.encode(t) for t in request.text], True
    raise BadRequestError("Either text, input_ids or input_embeds should be provided.")


def _check_num_sequences(num_sequences: int, max_sequences: int) -> None:
    if num_sequences > max_sequences:
        raise BadRequestError(
            f"The request asks for {num_sequences} sequences (prompts x n) but the engine runs at most "
            f"{max_sequences} at once (max_running_requests): split it into several requests."
        )


def _per_item(value: Any, size: int, name: str) -> list[Any]:
    """A list value gives one entry per item (token_ids_logprob: only a list of lists); else broadcast."""
    if isinstance(value, list) and (name != "token_ids_logprob" or (value and isinstance(value[0], list))):
        if len(value) != size:
            raise BadRequestError(f"{name} has {len(value)} entries but the batch has {size} items")
        return list(value)
    return [value] * size


def _logprob_options(request: GenerateRequest, size: int, vocab_size: int) -> list[LogprobOptions]:
    flags = _per_item(request.return_logprob, size, "return_logprob")
    starts = _per_item(request.logprob_start_len, size, "logprob_start_len")
    tops = _per_item(request.top_logprobs_num, size, "top_logprobs_num")
    ids = _per_item(request.token_ids_logprob, size, "token_ids_logprob")
    options = []
    for i in range(size):
        top = int(tops[i] or 0)
        if top < 0:
            raise BadRequestError(f"top_logprobs_num must be at least 0, got {top}.")
        wanted = None if ids[i] is None else tuple(int(t) for t in ids[i])
        if wanted is not None and any(not 0 <= t < vocab_size for t in wanted):
            raise BadRequestError(f"token_ids_logprob contains token ids outside the vocabulary [0, {vocab_size}).")
        start = -1 if starts[i] is None else int(starts[i])
        options.append(LogprobOptions(bool(flags[i]), start, top, wanted, request.return_text_in_logprobs))
    return options


def _rids(rid: str | list[str] | None, size: int, is_batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(size)]
    if isinstance(rid, list):
        if len(rid) != size:
            raise BadRequestError("The rid should be a list with the same length as the batch size.")
        return list(rid)
    return [f"{rid}_{i}" for i in range(size)] if is_batch else [rid]


def _check_prompt(prompt: list[int], options: LogprobOptions, limits: Limits) -> None:
    if not prompt:
        raise BadRequestError("input_ids cannot be empty.")
    if any(not 0 <= t < limits.vocab_size for t in prompt):
        raise BadRequestError(f"The input_ids contain token ids outside the vocabulary [0, {limits.vocab_size}).")
    if len(prompt) >= limits.context_length:
        raise BadRequestError(
            f"The input ({len(prompt)} tokens) is longer than the model's context length "
            f"({limits.context_length} tokens)."
        )
    if options.logprob_start_len > len(prompt):
        raise BadRequestError(
            f"logprob_start_len ({options.logprob_start_len}) is larger than the input length ({len(prompt)})."
        )


def _routed_experts_start(request: GenerateRequest, num_prompt_tokens: int, limits: Limits) -> int | None:
    """SGLang's check (its scheduler's, with its messages: the f-string `=` renderings included), made whenever
    routed experts are asked for, even when the engine does not record them."""
    if not request.return_routed_experts:
        return None
    start = request.routed_experts_start_len
    if start < 0:
        raise BadRequestError(
            f"recv_req.routed_experts_start_len={start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if start > num_prompt_tokens:
        raise BadRequestError(
            f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={num_prompt_tokens}. Please use a smaller routed_experts_start_len."
        )
    return start if limits.return_routed_experts else None


def _max_new_tokens(params: SamplingParams, num_prompt_tokens: int, limits: Limits) -> int:
    if params.max_new_tokens is None:
        max_new = max(0, min(limits.context_length, limits.max_total_tokens) - num_prompt_tokens)
    elif params.max_new_tokens + num_prompt_tokens >= limits.context_length:
        raise BadRequestError(
            f"Requested token count exceeds the model's maximum context length of {limits.context_length} tokens. "
            f"You requested a total of {params.max_new_tokens + num_prompt_tokens} tokens: {num_prompt_tokens} "
            f"tokens from the input and {params.max_new_tokens} tokens for the completion."
        )
    else:
        max_new = params.max_new_tokens
    if num_prompt_tokens + max_new > limits.max_total_tokens:
        raise BadRequestError(
            f"The request needs {num_prompt_tokens + max_new} KV-cache tokens (prompt + max_new_tokens) but the "
            f"engine holds {limits.max_total_tokens} (max_total_tokens)."
        )
    return max_new
