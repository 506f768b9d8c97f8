"""Request and response bodies of the engine's HTTP API: SGLang's native protocol (SGLang 0.5.x / HEAD names).

Unknown keys are ignored, as SGLang's /generate does (e.g. "model"). Fields SGLang has but this engine does not
implement are declared so that a request using them is refused with a 400 instead of silently misread. Value
checks of the weight-update bodies (ranks, dtypes, shapes) and of /generate (token ids, sampling parameters)
live in the core, so that they are answered with SGLang's bodies and messages rather than as schema errors; the
published schema still states them (`WithJsonSchema`, `json_schema_extra`: documented, not enforced here), so
that the document is as strict as the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, WithJsonSchema

from miles.common.contracts.engine_control import EnginePauseMode
from miles.engine.weights import FLOAT_DTYPE_BYTES, TENSOR_LOAD_FORMATS


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _null_or(*options: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [*options, {"type": "null"}]}


def _one_or_batch(item: dict[str, Any], **batch: Any) -> WithJsonSchema:
    """The schema of a /generate field given once (for every item) or as a list (one per batch item)."""
    return WithJsonSchema(_null_or(item, {"type": "array", "items": item, **batch}))


_TOKEN_IDS: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
"""Token ids of the served model (the app bounds them by its vocabulary); a prompt is never empty."""
_NOT_SUPPORTED = WithJsonSchema({"type": "null", "description": "Not supported by miles-engine: only null"})
_STRINGS: dict[str, Any] = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
SAMPLING_PARAMS_SCHEMA: dict[str, Any] = {
    "title": "SamplingParams",
    "description": "SGLang's sampling parameters (null = the default; unknown keys are ignored). Checked by the "
    "engine with SGLang's 400 messages. Only default values of SGLang's penalties and constrained decoding",
    "type": "object",
    "properties": {
        "max_new_tokens": {
            "type": ["integer", "null"],
            "minimum": 0,
            "description": "Default 128; null = up to the context. Prompt + max_new_tokens < context length",
        },
        "temperature": {"type": ["number", "null"], "minimum": 0},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1}, {"type": "null"}]},
        "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "stop": _null_or(_STRINGS),
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer"}},
        "stop_regex": _null_or(_STRINGS),
        "ignore_eos": {"type": ["boolean", "null"]},
        "skip_special_tokens": {"type": ["boolean", "null"]},
        "no_stop_trim": {"type": ["boolean", "null"]},
        "n": {"type": ["integer", "null"], "minimum": 1},
        "sampling_seed": {"type": ["integer", "null"]},
        "frequency_penalty": {"enum": [0, None]},
        "presence_penalty": {"enum": [0, None]},
        "repetition_penalty": {"enum": [1, None]},
        "min_new_tokens": {"enum": [0, None]},
        **{name: {"type": "null"} for name in ("json_schema", "regex", "ebnf", "structural_tag", "logit_bias")},
        "custom_params": {"type": "null"},
    },
}
"""The document's `sampling_params` (miles.engine.requests.SamplingParams.from_dict checks them)."""


class GenerateRequest(_Body):
    """POST /generate: one prompt (`text` str or `input_ids` list of ints) or a batch (lists of them)."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "description": "One prompt (`text`, or `input_ids`) or a batch (lists of them). Unknown keys are ignored",
            "anyOf": [
                {"required": ["text"], "properties": {"text": {"not": {"type": "null"}}}},
                {"required": ["input_ids"], "properties": {"input_ids": {"not": {"type": "null"}}}},
            ],
        },
    )

    text: Annotated[str | list[str] | None, _one_or_batch({"type": "string", "minLength": 1}, minItems=1)] = None
    input_ids: Annotated[
        list[int] | list[list[int]] | None, WithJsonSchema(_null_or(_TOKEN_IDS, {**_TOKEN_IDS, "items": _TOKEN_IDS}))
    ] = None
    input_embeds: Annotated[Any, _NOT_SUPPORTED] = None
    sampling_params: Annotated[
        dict[str, Any] | list[dict[str, Any]] | None, _one_or_batch(SAMPLING_PARAMS_SCHEMA, minItems=1)
    ] = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    """-1 (or any negative): no input logprobs; else at most the prompt length."""
    top_logprobs_num: Annotated[int | list[int] | None, _one_or_batch({"type": ["integer", "null"], "minimum": 0})] = (
        None
    )
    token_ids_logprob: Annotated[
        list[int] | list[list[int]] | None,
        _one_or_batch({"type": "array", "items": _TOKEN_IDS["items"]}),
    ] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_prompt_token_ids: bool = False
    return_routed_experts: bool = Field(
        default=False,
        description="MoE routing replay (R3). With --enable-return-routed-experts the last response (or stream "
        "chunk) of each sequence carries `meta_info.routed_experts`: base64 of little-endian int32 shaped "
        "(prompt_tokens + completion_tokens - 1 - routed_experts_start_len, MoE layers, experts per token), the "
        "experts each position was routed to when it was fed. Without the flag nothing is returned (as SGLang)",
    )
    routed_experts_start_len: int = Field(
        default=0,
        description="First position whose routing `return_routed_experts` returns, at most the prompt length (else "
        "400 with SGLang's message); only checked when routed experts are asked for",
        json_schema_extra={"minimum": 0},
    )
    extra_key: str | list[str] | None = None
    """Cache namespace: sequences with different extra keys never share cached prefixes."""
    min_weight_version: int | None = None
    """miles extension (docs/architecture.md §4.4): refuse with a retryable 409 unless the engine serves at least this
    weight version. Also read from the X-Miles-Min-Weight-Version header."""
    session_params: Annotated[dict[str, Any] | None, _NOT_SUPPORTED] = None
    image_data: Annotated[Any, _NOT_SUPPORTED] = None
    video_data: Annotated[Any, _NOT_SUPPORTED] = None
    audio_data: Annotated[Any, _NOT_SUPPORTED] = None
    lora_path: str | list[str | None] | None = None
    """Name of a loaded LoRA adapter (/load_lora_adapter's lora_name) to run with, or one per batch item (null: the
    base model). An adapter that is not loaded is a 400."""


class LoadLoRAAdapterBody(_Body):
    """POST /load_lora_adapter (SGLang's LoadLoRAAdapterReqInput)."""

    lora_name: str
    """The name /generate's `lora_path` uses."""
    lora_path: str
    """A Hugging Face PEFT adapter directory (adapter_config.json, adapter_model.safetensors) for this base model."""
    pinned: bool = False
    """Accepted; every loaded adapter stays resident here (nothing to pin)."""


class UnloadLoRAAdapterBody(_Body):
    """POST /unload_lora_adapter (SGLang's UnloadLoRAAdapterReqInput)."""

    lora_name: str


class LoRAUpdateResponse(BaseModel):
    """SGLang's LoRAUpdateOutput: 200 with success true, or 400 with success false and `error_message`."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None
    """lora_name -> lora_path of every adapter loaded after the call."""


class AbortRequestBody(_Body):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationBody(_Body):
    mode: EnginePauseMode = "abort"


class ContinueGenerationBody(_Body):
    torch_empty_cache: bool = True


_NON_EMPTY: dict[str, Any] = {"minLength": 1}
_TENSOR_PAYLOADS: dict[str, Any] = {"minItems": 1, "items": {"type": "string", "contentEncoding": "base64"}}
_TENSOR_LOAD_FORMAT: dict[str, Any] = {"enum": list(TENSOR_LOAD_FORMATS)}
_DTYPES: list[JsonValue] = list(FLOAT_DTYPE_BYTES)


class UpdateWeightsFromDiskBody(_Body):
    model_path: str = Field(json_schema_extra=_NON_EMPTY)
    """A checkpoint directory holding *.safetensors (same architecture and shapes)."""
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    torch_empty_cache: bool = False


class UpdateWeightsFromTensorBody(_Body):
    serialized_named_tensors: list[str] = Field(
        description="base64 of safetensors bytes, one entry per chunk (see miles.engine.weights)",
        json_schema_extra=_TENSOR_PAYLOADS,
    )
    load_format: str | None = Field(default=None, json_schema_extra=_TENSOR_LOAD_FORMAT)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: bool = False


class StageWeightsFromTensorBody(_Body):
    """POST /stage_weights_from_tensor (miles extension): decode and hold tensors without applying them."""

    serialized_named_tensors: list[str] = Field(
        description="base64 of safetensors bytes, one entry per chunk, as /update_weights_from_tensor",
        json_schema_extra=_TENSOR_PAYLOADS,
    )
    load_format: str | None = Field(default=None, json_schema_extra=_TENSOR_LOAD_FORMAT)
    stage_id: str = Field(min_length=1, max_length=200, description="names the stage; a new id drops the previous")


class ApplyStagedWeightsBody(_Body):
    """POST /apply_staged_weights (miles extension): swap the staged tensors in, as /update_weights_from_tensor."""

    stage_id: str = Field(min_length=1, max_length=200)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightVersionBody(_Body):
    new_version: str
    abort_all_requests: bool = True


class MemoryOccupationBody(_Body):
    tags: list[str] | None = None


class InitWeightsUpdateGroupBody(_Body):
    """POST /init_weights_update_group: join the trainer's weight-update group as rank `rank_offset`."""

    master_address: str = Field(json_schema_extra=_NON_EMPTY)
    """Host of the rendezvous store (the trainer, rank 0)."""
    master_port: int = Field(json_schema_extra={"minimum": 1, "maximum": 65535})
    world_size: int = Field(json_schema_extra={"minimum": 2})
    """Ranks in the group: the trainer's plus every engine rank."""
    rank_offset: int = Field(json_schema_extra={"minimum": 1})
    """This engine's rank in the group (plus its tensor-parallel rank, always 0 here), below world_size."""
    group_name: str = Field(default="weight_update_group", json_schema_extra=_NON_EMPTY)
    backend: str = Field(default="nccl", json_schema_extra={"enum": ["nccl", "gloo"]})
    """nccl (needs CUDA) or gloo (CPU)."""


class UpdateWeightsFromDistributedBody(_Body):
    """POST /update_weights_from_distributed: receive these tensors, broadcast by rank 0 in this order."""

    names: list[str] = Field(json_schema_extra={"minItems": 1, "uniqueItems": True})
    """Hugging Face tensor names; any subset of the model's weights, each at most once."""
    dtypes: list[str] = Field(json_schema_extra={"items": {"type": "string", "enum": _DTYPES}})
    """torch dtype names without "torch." (float32, bfloat16, float16, float64), one per name."""
    shapes: list[list[int]] = Field(
        json_schema_extra={"items": {"type": "array", "items": {"type": "integer", "minimum": 0}}}
    )
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = Field(default=None, json_schema_extra={"type": "null"})
    """Only null (one broadcast per tensor); SGLang's bucketed formats are refused."""
    torch_empty_cache: bool = False
    """Accepted for compatibility; a CPU engine has no allocator cache to empty."""


class DestroyWeightsUpdateGroupBody(_Body):
    group_name: str = "weight_update_group"


class CheckWeightsBody(_Body):
    """GET|POST /weights_checker (SGLang's CheckWeightsReqInput; `dtype` is a miles extension)."""

    action: str = Field(default="checksum", json_schema_extra={"enum": ["checksum"]})
    """Only "checksum" is served."""
    dtype: str | None = Field(default=None, json_schema_extra={"enum": [*_DTYPES, None]})
    """Convert every weight to this dtype before hashing (default: the dtype the engine holds them in)."""


class SchemaErrorBody(BaseModel):
    """SGLang's answer (400) to a body that is not JSON or breaks the schema (OpenAI's error shape)."""

    object: Literal["error"]
    message: str
    """Every problem: `field.path: what is wrong`, separated by "; "."""
    type: Literal["Bad Request"]
    param: None
    code: Literal[400]


class PauseResponse(BaseModel):
    """/pause_generation and /continue_generation."""

    message: str
    status: Literal["ok"]


class SuccessResponse(BaseModel):
    """SGLang's answer to control calls: 200 with success true, or 400 with success false."""

    success: bool
    message: str


class DiskUpdateResponse(SuccessResponse):
    """/update_weights_from_disk (200 with success true, or 400 with success false)."""

    num_paused_requests: int
    """Requests held by a pause while the weights were swapped (0 when not paused)."""


class WeightVersionResponse(SuccessResponse):
    """/update_weight_version."""

    new_version: str


class WeightsChecksum(BaseModel):
    """The served weights' content address (miles extension of /weights_checker's answer)."""

    weight_version: str
    """The version the digest was taken at (read atomically with the weights)."""
    dtype: str
    """dtype the weights were converted to before hashing."""
    digest: str
    """miles.common.weights.weights_digest over the weights' Hugging Face names and raw little-endian bytes."""
    exact: bool
    """Whether converting to `dtype` lost nothing (every value round-trips bit for bit)."""
    num_tensors: int


class WeightsCheckerResponse(SuccessResponse):
    payload: WeightsChecksum | None = None
