"""The session's data types, their invariants, and their storage encoding (shared by both store backends).

A session is: `SessionMeta` (fixed at creation: owner token hash, job, resolved model config), `SessionState`
(what each turn reads: message history, the token buffer, tools, per-record message ends, a version counter) and
the list of `TurnRecord`s (one per committed model call, read only for samples, GET and a rollback) with, when
the session records routing (R3), one packed routing chunk per record beside it (read only for samples).

Token buffer invariant: `token_ids` is the last record's prompt ids + completion ids; record i's prompt is
`token_ids[:records[i].prompt_len]` for every i (TITO only appends, and trims at most `max_trim_tokens` of a
completion, which is never its first token), so records store lengths and sampled ids, never whole prompts.
"""

from __future__ import annotations

import json
import sys
from array import array
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

Json = dict[str, Any]
SAMPLING_KEYS: frozenset[str] = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "sampling_seed",
    }
)
"""SGLang sampling_params a job or session may set as defaults."""


@dataclass(frozen=True)
class ModelConfig:
    """How a job's sessions are served: what the controller registers with PUT /v1/jobs/{job_id}/config."""

    model_path: str
    model_family: str
    engine_pool: str
    max_context_tokens: int | None = None
    chat_template_kwargs: Json = field(default_factory=dict)
    sampling_defaults: Json = field(default_factory=dict)
    max_new_tokens: int | None = None
    """The most tokens one turn may generate, whatever the request asks (None: only the context limits it)."""
    split_special_tokens: bool = True
    """Token strings in user, system and tool text and in the tool list are encoded as plain text."""
    record_routing: bool = False
    """Routing replay (R3): every turn asks the engine for its routed experts and samples carry them. Resolved
    when the job config is PUT (its None: on when the model is MoE); needs a MoE model."""
    roles: list[str] = field(default_factory=list)
    """The roles the job's sessions may take (multi-agent episodes); empty: sessions have no role."""
    tree_sessions: bool = False
    """The job's sessions are trees (tree.py) unless a session asks otherwise."""
    lora_adapter: bool = False
    """A LoRA job on a shared engine pool: every generate request names the job's live adapter (adapters.py)."""

    def to_json(self) -> Json:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Json) -> ModelConfig:
        """Configs stored before a field existed get that field's behaviour of then (no cap, no split, no
        routing)."""
        return cls(
            model_path=str(data["model_path"]),
            model_family=str(data["model_family"]),
            engine_pool=str(data["engine_pool"]),
            max_context_tokens=data.get("max_context_tokens"),
            chat_template_kwargs=dict(data.get("chat_template_kwargs") or {}),
            sampling_defaults=dict(data.get("sampling_defaults") or {}),
            max_new_tokens=data.get("max_new_tokens"),
            split_special_tokens=bool(data.get("split_special_tokens", False)),
            record_routing=bool(data.get("record_routing", False)),
            roles=[str(role) for role in data.get("roles") or []],
            tree_sessions=bool(data.get("tree_sessions", False)),
            lora_adapter=bool(data.get("lora_adapter", False)),
        )


@dataclass(frozen=True)
class LiveAdapter:
    """The adapter version a LoRA job's turns are served with now (PUT /v1/jobs/{job_id}/adapter).

    Invariant (checked when it is set): `lora_name` is `adapter_name(job_id, weight_version)`."""

    lora_name: str
    weight_version: int

    def to_json(self) -> Json:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Json) -> LiveAdapter:
        return cls(lora_name=str(data["lora_name"]), weight_version=int(data["weight_version"]))


@dataclass(frozen=True)
class SessionMeta:
    """Fixed at creation. `model` is resolved then (job config + session overrides) and never changes after."""

    session_id: str
    token_sha256: str
    job_id: str
    episode_id: str
    model: ModelConfig
    metadata: Json
    ttl_s: float
    created_at_unix_ms: int
    role: str = ""
    """The session's role in a multi-agent episode (one of the job's roles; "" for none): on every sample."""
    tree: bool = False
    """A tree session (tree.py): turns may fork, retry at any depth and start new roots; else linear."""

    def to_json(self) -> Json:
        data = asdict(self)
        data["model"] = self.model.to_json()
        return data

    @classmethod
    def from_json(cls, data: Json) -> SessionMeta:
        return cls(
            session_id=str(data["session_id"]),
            token_sha256=str(data["token_sha256"]),
            job_id=str(data["job_id"]),
            episode_id=str(data["episode_id"]),
            model=ModelConfig.from_json(data["model"]),
            metadata=dict(data.get("metadata") or {}),
            ttl_s=float(data["ttl_s"]),
            created_at_unix_ms=int(data["created_at_unix_ms"]),
            role=str(data.get("role") or ""),
            tree=bool(data.get("tree", False)),
        )


@dataclass(frozen=True)
class IdempotencyRecord:
    """An Idempotency-Key of POST /v1/sessions, bound to the session it created; it lives as long as the session."""

    key_sha256: str
    """SHA-256 of the key (keys are caller-chosen strings of any shape; only the digest is stored)."""
    session_id: str
    body_sha256: str
    """SHA-256 of the canonical JSON of the parsed create body: a replay must carry the same."""

    def to_text(self) -> str:
        return f"{self.session_id} {self.body_sha256}"

    @classmethod
    def from_text(cls, key_sha256: str, text: str) -> IdempotencyRecord:
        session_id, _, body_sha256 = text.partition(" ")
        return cls(key_sha256, session_id, body_sha256)


class FinishType(StrEnum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True)
class TurnRecord:
    """One committed model call. `logprobs[i]` belongs to `completion_ids[i]` (None: the engine sent null)."""

    turn_index: int
    prompt_len: int
    num_trimmed_tokens: int
    """Tokens of the previous completion the junction patch replaced when this prompt was built."""
    completion_ids: list[int]
    logprobs: list[float | None]
    weight_version: str
    cached_tokens: int
    prompt_tokens: int
    finish_type: FinishType
    finish_matched: int | str | None
    messages_end: int
    """Length of the message history after this turn's assistant message."""
    created_at_unix_ms: int
    upstream_latency_s: float
    routing_start_row: int | None = None
    """First token position whose routing this turn's stored chunk holds (the engine's routed_experts_start_len);
    the chunk covers [routing_start_row, prompt_len + len(completion_ids) - 1). None: no routing recorded."""
    weight_version_spans: list[tuple[int, int, str]] | None = None
    """[start, end, weight_version] over completion_ids when the engine sampled them with more than one version
    (a pause carried the call across a weight update); None: every token is `weight_version`'s."""

    def to_json(self, *, copy_arrays: bool = True) -> Json:
        """`copy_arrays=False`: the JSON shares this record's id and logprob lists (for a record no one else holds)."""
        # Not dataclasses.asdict: its deep copy walks every id and logprob in Python (a 100k-token turn: ~50 ms).
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        if copy_arrays:
            data["completion_ids"], data["logprobs"] = list(self.completion_ids), list(self.logprobs)
        data["finish_type"] = self.finish_type.value
        return data

    @classmethod
    def from_json(cls, data: Json) -> TurnRecord:
        return cls(
            turn_index=int(data["turn_index"]),
            prompt_len=int(data["prompt_len"]),
            num_trimmed_tokens=int(data["num_trimmed_tokens"]),
            completion_ids=list(map(int, data["completion_ids"])),
            logprobs=[None if lp is None else float(lp) for lp in data["logprobs"]],
            weight_version=str(data["weight_version"]),
            cached_tokens=int(data["cached_tokens"]),
            prompt_tokens=int(data["prompt_tokens"]),
            finish_type=FinishType(data["finish_type"]),
            finish_matched=data.get("finish_matched"),
            messages_end=int(data["messages_end"]),
            created_at_unix_ms=int(data["created_at_unix_ms"]),
            upstream_latency_s=float(data["upstream_latency_s"]),
            routing_start_row=None if data.get("routing_start_row") is None else int(data["routing_start_row"]),
            weight_version_spans=_spans_from_json(data.get("weight_version_spans")),
        )


def _spans_from_json(raw: Any) -> list[tuple[int, int, str]] | None:
    """A stored TurnRecord's weight_version_spans (absent in records written before they were kept)."""
    return None if raw is None else [(int(start), int(end), str(label)) for start, end, label in raw]


@dataclass(frozen=True)
class SessionState:
    """What a turn reads under the lock. `version` counts commits and fences them."""

    version: int = 0
    messages: list[Json] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    tools: list[Json] | None = None
    message_ends: list[int] = field(default_factory=list)
    """`TurnRecord.messages_end` of every record, in order (rollback needs only these)."""
    num_not_recorded: int = 0
    """Turns answered but not recorded (a concurrent turn on the session committed first)."""

    @property
    def num_records(self) -> int:
        return len(self.message_ends)


@dataclass(frozen=True)
class SessionSnapshot:
    meta: SessionMeta
    state: SessionState


@dataclass(frozen=True)
class TurnCommit:
    """Phase 3's write: keep the first `num_kept_records` records (a rollback drops one), then append `record`."""

    expected_version: int
    num_kept_records: int
    messages: list[Json]
    token_ids: list[int]
    tools: list[Json] | None
    record: TurnRecord
    message_ends: list[int]
    """The state's message_ends after the commit: the kept ones + record.messages_end."""
    ttl_s: float
    """The session's ttl_s (the commit restarts its expiry clock)."""
    routing: bytes | None = None
    """The record's routing chunk (packed rows, `miles.common.contracts.routing`) when the session records
    routing: appended beside the record (the kept chunks are never rewritten), trimmed with the records."""


class CommitOutcome(StrEnum):
    COMMITTED = "committed"
    CONCURRENT_TURN = "concurrent_turn"
    """Another turn on the session committed (or rolled back) since this one read the session."""
    SESSION_GONE = "session_gone"
    """The session was deleted or expired while the engine generated."""
    TREE_FULL = "tree_full"
    """A tree session reached max_tree_nodes or max_tree_tokens while the engine generated (concurrent branches)."""


def pack_ids(ids: list[int]) -> bytes:
    """Token ids as little-endian int32 bytes (4 bytes a token)."""
    packed = array("i", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(data: bytes | memoryview | None) -> list[int]:
    return unpack_array("i", data) if data else []


UNPACK_SLICE_ITEMS = 65536
"""Arrays are unpacked this many items at a time: a 3M-token buffer in one `tolist` holds the GIL ~30 ms, in
whatever thread it runs, and every live turn of the replica waits behind it."""


def unpack_array(typecode: str, data: bytes | memoryview) -> list[Any]:
    """The little-endian `array(typecode)` in `data` as a list, built UNPACK_SLICE_ITEMS at a time."""
    view = memoryview(data)
    step = UNPACK_SLICE_ITEMS * array(typecode).itemsize
    out: list[Any] = []
    for start in range(0, len(view), step):
        part = array(typecode)
        part.frombytes(view[start : start + step])
        if sys.byteorder != "little":
            part.byteswap()
        out.extend(part.tolist())
    return out


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
