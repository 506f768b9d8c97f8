"""Request and response bodies of the HTTP API (pydantic; their JSON schemas are published in the OpenAPI).

Bodies are flat on purpose (messages and tools stay plain JSON objects: TITO validates them and names the bad
field), so every schema is self-contained.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from miles.session.records import SAMPLING_KEYS
from miles.session.tito.families import family_names
from miles.session.tito.messages import ROLES

JOB_ID_PATTERN = r"^[^\s{}/]{1,200}$"
ROLE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
NODE_ID_PATTERN = r"^[0-9a-f]{16}$"
MAX_ROLES = 8
MIN_TTL_S = 1.0
"""Shortest ttl_s a session may ask for (its store keys expire with millisecond resolution)."""
FAMILY_SCHEMA: dict[str, Any] = {"enum": list(family_names())}
"""Stated in the schema (the registered TITO families); checked when the model is resolved (400 naming it)."""
MESSAGE_SCHEMA: dict[str, Any] = {
    "items": {"type": "object", "required": ["role"], "properties": {"role": {"enum": list(ROLES)}}}
}
"""The shape the schema states for each message; TITO checks the rest (content, tool calls) naming the field."""
_NAMED: dict[str, Any] = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
TOOLS_SCHEMA: dict[str, Any] = {
    "items": {
        "type": "object",
        "anyOf": [{"required": ["function"], "properties": {"function": _NAMED}}, _NAMED],
        "description": 'An OpenAI tool, `{"type": "function", "function": {"name", "description", "parameters"}}` '
        "(a bare function object is accepted too)",
    }
}
MAX_TOKENS_RULE = (
    "Absent: the largest completion that fits, context - prompt - 1 tokens, capped by the job's max_new_tokens. "
    "A larger value is clamped to that limit, never refused (reported in `miles.max_tokens_clamped_from` and the "
    "X-Miles-Max-Tokens-Clamped-From header). max_tokens and max_completion_tokens are the same limit: when both "
    "are given the smaller counts."
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sampling_keys(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """Known SGLang keys only; the two the server computes with are type-checked (the engine checks the rest)."""
    unknown = sorted(set(value or {}) - SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {sorted(SAMPLING_KEYS)}")
    max_new = (value or {}).get("max_new_tokens")
    if max_new is not None and not (_is_int(max_new) and max_new >= 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1 (got {max_new!r})")
    stop_ids = (value or {}).get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(_is_int(i) and i >= 0 for i in stop_ids)):
        raise ValueError("stop_token_ids must be a list of token ids (integers >= 0)")
    return value


class JobConfigBody(BaseModel):
    """PUT /v1/jobs/{job_id}/config: how the job's sessions are served (registered by the controller)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1, description="Model directory readable by every replica (HF layout)")
    model_family: str = Field(
        min_length=1, description="TITO family, e.g. qwen3 (`miles-tito families`)", json_schema_extra=FAMILY_SCHEMA
    )
    engine_pool: str = Field(default="default", min_length=1, description="Sent as X-Miles-Pool")
    max_context_tokens: int | None = Field(default=None, ge=2, description="Default: config.json's")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    sampling_defaults: dict[str, Any] = Field(
        default_factory=dict,
        description="SGLang sampling_params; its max_new_tokens is the default of requests without max_tokens",
    )
    max_new_tokens: int | None = Field(
        default=None,
        ge=1,
        description="The most tokens one turn may generate: requests asking more (or nothing) are clamped to it. "
        "Absent: only the context limits a completion",
    )
    split_special_tokens: bool = Field(
        default=True,
        description="Encode special/added token strings in user, system and tool messages and in the tool list as "
        "plain text, so that typed or tool-returned `<|im_end|>` can never become a control token. Off: they are "
        "encoded as the tokens they spell (the vendor templates' behaviour)",
    )
    record_routing: bool | None = Field(
        default=None,
        description="Rollout Routing Replay (R3): every turn asks the engine for its routed experts (only the "
        "positions not stored yet), the session stores them packed and every sample carries "
        "`rollout_routed_experts` (len(tokens) - 1 rows); the agent never sees them. None: on when the model at "
        "model_path is MoE (config.json model_type qwen3_moe). true with a dense model is a 400 "
        "(invalid_job_config, field record_routing). The job's engines must run with --enable-return-routed-experts",
    )
    roles: list[str] = Field(
        default_factory=list,
        max_length=MAX_ROLES,
        description="The roles of a multi-agent episode's sessions (e.g. solver, verifier): a session created "
        "with a role must name one of them, and its samples carry metadata.role. Empty: sessions take no role",
        json_schema_extra={"items": {"type": "string", "pattern": ROLE_PATTERN}, "uniqueItems": True},
    )
    tree_sessions: bool = Field(
        default=False,
        description="The job's sessions are trees unless a session asks otherwise: a turn may fork from any "
        "earlier node, retry deep in the history, or start a new root (compaction); samples are one per leaf path",
    )
    lora_adapter: bool = Field(
        default=False,
        description="A LoRA job on a shared engine pool: every generate request of the job names its live adapter "
        "version (`lora_path`), which the trainer sets with PUT /v1/jobs/{job_id}/adapter; turns record that "
        "version",
    )

    _sampling = field_validator("sampling_defaults")(check_sampling_keys)

    @field_validator("roles")
    @classmethod
    def _roles(cls, value: list[str]) -> list[str]:
        bad = [role for role in value if not re.fullmatch(ROLE_PATTERN, role)]
        if bad:
            raise ValueError(f"roles must match {ROLE_PATTERN} (got {bad})")
        if len(set(value)) != len(value):
            raise ValueError(f"roles must be unique (got {value})")
        return value


class JobAdapterBody(BaseModel):
    """PUT /v1/jobs/{job_id}/adapter (the trainer, after loading the version into every engine of the pool) and its
    answer, as GET returns it: the adapter version the job's turns are served with from now on."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(
        min_length=1,
        max_length=256,
        description="The SGLang lora_name the version is loaded under: `<job_id>@<weight_version>`",
    )
    weight_version: int = Field(
        ge=0, strict=True, description="The adapter version; never lower than the live one (equal: idempotent)"
    )


class CreateSessionRequest(BaseModel):
    """POST /v1/sessions: a JSON object, every field optional (`{}` takes every default; no body is a 422)."""

    model_config = ConfigDict(extra="forbid")

    job_id: str | None = Field(default=None, pattern=JOB_ID_PATTERN)
    episode_id: str | None = Field(default=None, min_length=1, max_length=200)
    model_family: str | None = Field(
        default=None,
        min_length=1,
        description="Overrides the job's TITO family",
        json_schema_extra={"enum": [*FAMILY_SCHEMA["enum"], None]},
    )
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="Merged over the job's")
    sampling_defaults: dict[str, Any] | None = Field(default=None, description="Merged over the job's")
    metadata: dict[str, Any] | None = None
    ttl_s: float | None = Field(
        default=None,
        ge=MIN_TTL_S,
        allow_inf_nan=False,
        description="Idle expiry in seconds, at least 1 and at most the server's max_ttl_s; default: the "
        "server's default_ttl_s",
    )
    role: str | None = Field(
        default=None,
        pattern=ROLE_PATTERN,
        description="The session's role in a multi-agent episode: one of the job's declared roles (400 otherwise); "
        "every sample carries it as metadata.role",
    )
    tree: bool | None = Field(
        default=None,
        description="A tree session (turns may fork, retry at any depth, or start a new root) or a linear one; "
        "default: the job's tree_sessions",
    )

    _sampling = field_validator("sampling_defaults")(check_sampling_keys)


class CreateSessionResponse(BaseModel):
    session_id: str
    base_url: str = Field(description="OpenAI base URL for the agent: <server>/v1/sessions/<id>/v1")
    token: str = Field(
        description="The session's capability token: the agent's api_key. An Idempotency-Key replay returns a new "
        "one and the earlier token stops working"
    )
    ttl_s: float


class SamplesRequest(BaseModel):
    """POST /v1/sessions/{id}/samples."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["merge", "per_turn"] = "merge"
    max_seq_len: int | None = Field(default=None, ge=1, description="Prompt + every turn, in tokens")
    reward: float = Field(default=0.0, description="Copied into every sample")
    group_id: str = ""
    metadata: dict[str, Any] | None = Field(default=None, description="Merged into every sample's metadata")

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("reward must be finite")
        return value


class ChatCompletionRequest(BaseModel):
    """OpenAI Chat Completions, as a session serves it. Unknown OpenAI fields (user, metadata, ...) are ignored.

    `tool_choice` is accepted but not enforced (the model decides); `n` must be 1.
    """

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra=MESSAGE_SCHEMA)
    model: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, json_schema_extra=TOOLS_SCHEMA)
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, description=f"Most tokens to generate. {MAX_TOKENS_RULE}")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description=f"Most tokens to generate (OpenAI's newer name). {MAX_TOKENS_RULE}"
    )
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parent_node_id: str | None = Field(
        default=None,
        pattern=NODE_ID_PATTERN,
        description="Tree sessions only: place this turn under that node (its history must be a prefix of "
        "messages). Default: the deepest node whose history is a strict prefix of messages, else a new root",
    )
    response_format: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={
            "anyOf": [
                {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
                {"type": "null"},
            ]
        },
    )

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported (no constrained decoding)")
        return value

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))
