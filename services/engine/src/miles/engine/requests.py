"""The engine's internal request types: validated sampling parameters, finish reasons, per-token logprobs, the
scheduler's per-sequence state and the updates it sends back to the HTTP side.

Validation messages follow SGLang's (`sampling_params.py`) so clients see the same text.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.engine.errors import BadRequestError
from miles.engine.radix_cache import CacheNamespace

TOP_K_ALL = 1 << 30
GREEDY_TEMPERATURE = 1e-6
_UNSUPPORTED_NON_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}


def _as_str_tuple(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise BadRequestError(f"{name} must be a string or a list of strings")


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling parameters (JSON null means the default). max_new_tokens None: up to the context."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def logprob_temperature(self) -> float:
        """Temperature the reported logprobs are scaled by (1 for greedy, as SGLang maps greedy to T=1, top_k=1)."""
        return 1.0 if self.greedy else self.temperature

    @property
    def needs_filtering(self) -> bool:
        return self.top_k < TOP_K_ALL or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        values = {key: value for key, value in (raw or {}).items() if value is not None}
        for key, default in _UNSUPPORTED_NON_DEFAULTS.items():
            if key in values and values[key] != default:
                raise BadRequestError(f"sampling_params.{key} is not supported by miles-engine")
        # max_new_tokens is the one field where an explicit null means something: no limit but the context.
        max_new = (raw or {}).get("max_new_tokens", 128)
        params = cls(
            max_new_tokens=None if max_new is None else _int(max_new, "max_new_tokens"),
            temperature=_float(values.get("temperature", 1.0), "temperature"),
            top_p=_float(values.get("top_p", 1.0), "top_p"),
            top_k=_int(values.get("top_k", TOP_K_ALL), "top_k"),
            min_p=_float(values.get("min_p", 0.0), "min_p"),
            stop=_as_str_tuple(values.get("stop"), "stop"),
            stop_token_ids=frozenset(_int(t, "stop_token_ids") for t in values.get("stop_token_ids", [])),
            stop_regex=_as_str_tuple(values.get("stop_regex"), "stop_regex"),
            ignore_eos=bool(values.get("ignore_eos", False)),
            skip_special_tokens=bool(values.get("skip_special_tokens", True)),
            no_stop_trim=bool(values.get("no_stop_trim", False)),
            n=_int(values.get("n", 1), "n"),
            sampling_seed=None if "sampling_seed" not in values else _int(values["sampling_seed"], "sampling_seed"),
        )
        params.verify()
        return params

    def verify(self) -> None:
        """SGLang's checks, with its messages."""
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise BadRequestError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequestError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequestError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise BadRequestError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise BadRequestError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.n < 1:
            raise BadRequestError(f"n must be at least 1, got {self.n}.")

    def __post_init__(self) -> None:
        if self.top_k == -1:
            object.__setattr__(self, "top_k", TOP_K_ALL)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise BadRequestError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequestError(f"{name} must be a number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LogprobOptions:
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_text_in_logprobs: bool = False


@dataclass(frozen=True)
class FinishReason:
    """SGLang's finish_reason object: stop (matched id or string), length, or abort."""

    kind: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    in_waiting_queue: bool = False

    @classmethod
    def stop_token(cls, token_id: int) -> FinishReason:
        return cls("stop", matched=token_id)

    @classmethod
    def stop_string(cls, matched: str) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def max_length(cls, max_new_tokens: int) -> FinishReason:
        return cls("length", length=max_new_tokens)

    @classmethod
    def abort(cls, *, waiting: bool = False, message: str | None = None) -> FinishReason:
        text = message or ("Abort in waiting queue" if waiting else "Aborted")
        return cls("abort", message=text, in_waiting_queue=waiting)

    def to_json(self) -> dict[str, Any]:
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.length}
        if self.in_waiting_queue:
            return {"type": "abort", "message": self.message}
        return {"type": "abort", "message": self.message, "status_code": self.status_code, "err_type": None}


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of one position's token, plus top-k and requested-id logprobs as (logprob, token_id) pairs."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[float, int], ...] | None = None
    by_id: tuple[tuple[float, int], ...] | None = None


@dataclass(frozen=True)
class SeqUpdate:
    """What the scheduler tells the HTTP side about one sequence after a step (cumulative state is kept there)."""

    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    cached_tokens: int | None = None
    input_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    finish: FinishReason | None = None
    weight_version: str = "default"
    routed_experts: bytes | None = None
    """On the finishing update of a sequence that asked for them: little-endian int32 (rows, MoE layers, top-k)."""


@dataclass(eq=False)
class Sequence:
    """One sequence in the scheduler (one item of a /generate batch, one sample of n).

    Invariant: `output_ids` only grows; `cached_tokens` is set at the first admission and never recounted.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    logprobs: LogprobOptions
    max_new_tokens: int
    emit: Callable[[SeqUpdate], None]
    arrival_order: int = 0
    arrival_time_s: float = 0.0
    internal: bool = False
    namespace: CacheNamespace = None
    lora_id: str | None = None
    """The loaded LoRA adapter this sequence runs with (None: the base model); part of `namespace`."""
    routed_experts_start_len: int | None = None
    """Report the routing of positions [this, seqlen - 1) when the sequence ends (None: not asked for)."""
    rng: random.Random = field(default_factory=random.Random)
    output_ids: list[int] = field(default_factory=list)
    state: str = "new"
    cached_tokens: int | None = None
    prefix_node: Any = None
    reserved_tokens: int = 0
    kv: Any = None
    cache_epoch: int = -1
    num_retractions: int = 0
    prefilled: bool = False
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def token_stop_ids(self) -> frozenset[int]:
        return self.sampling.stop_token_ids


@dataclass(frozen=True)
class LoadSnapshot:
    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_tokens: int
    num_used_tokens: int
    max_total_num_tokens: int
    num_cached_tokens: int
    cache_hit_rate: float
    gen_throughput: float
    paused: str | None

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_num_tokens
