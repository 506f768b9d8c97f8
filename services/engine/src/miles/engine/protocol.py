"""Request and response bodies of the engine's HTTP API: SGLang's native protocol (SGLang 0.5.x / HEAD names).

Unknown keys are ignored, as SGLang's /generate does (e.g. "model"). Fields SGLang has but this engine does not
implement are declared so that a request using them is refused with a 400 instead of silently misread. Value
checks of the weight-update bodies (ranks, dtypes, shapes) live in the core, so that they are answered in
SGLang's `{"success": false, "message"}` shape rather than as schema errors.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GenerateRequest(_Body):
    """POST /generate: one prompt (`text` str or `input_ids` list of ints) or a batch (lists of them)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    input_embeds: Any = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_prompt_token_ids: bool = False
    return_routed_experts: bool = False
    """Accepted for compatibility; this engine serves no MoE model, so nothing is returned."""
    extra_key: str | list[str] | None = None
    """Cache namespace: sequences with different extra keys never share cached prefixes."""
    min_weight_version: int | None = None
    """miles extension (DESIGN.md §4.4): refuse with a retryable 409 unless the engine serves at least this
    weight version. Also read from the X-Miles-Min-Weight-Version header."""
    session_params: dict[str, Any] | None = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None


class AbortRequestBody(_Body):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationBody(_Body):
    torch_empty_cache: bool = True


class UpdateWeightsFromDiskBody(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    torch_empty_cache: bool = False


class UpdateWeightsFromTensorBody(_Body):
    serialized_named_tensors: list[str] = Field(
        description="base64 of safetensors bytes, one entry per chunk (see miles.engine.weights)"
    )
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: bool = False


class StageWeightsFromTensorBody(_Body):
    """POST /stage_weights_from_tensor (miles extension): decode and hold tensors without applying them."""

    serialized_named_tensors: list[str] = Field(
        description="base64 of safetensors bytes, one entry per chunk, as /update_weights_from_tensor"
    )
    load_format: str | None = None
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

    master_address: str
    """Host of the rendezvous store (the trainer, rank 0)."""
    master_port: int
    world_size: int
    """Ranks in the group: the trainer's plus every engine rank."""
    rank_offset: int
    """This engine's rank in the group (plus its tensor-parallel rank, always 0 here)."""
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    """nccl (needs CUDA) or gloo (CPU)."""


class UpdateWeightsFromDistributedBody(_Body):
    """POST /update_weights_from_distributed: receive these tensors, broadcast by rank 0 in this order."""

    names: list[str]
    """Hugging Face tensor names; any subset of the model's weights, each at most once."""
    dtypes: list[str]
    """torch dtype names without "torch." (float32, bfloat16, float16, float64), one per name."""
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    """Only null (one broadcast per tensor); SGLang's bucketed formats are refused."""
    torch_empty_cache: bool = False
    """Accepted for compatibility; a CPU engine has no allocator cache to empty."""


class DestroyWeightsUpdateGroupBody(_Body):
    group_name: str = "weight_update_group"


class CheckWeightsBody(_Body):
    """GET|POST /weights_checker (SGLang's CheckWeightsReqInput; `dtype` is a miles extension)."""

    action: str = "checksum"
    """Only "checksum" is served."""
    dtype: str | None = None
    """Convert every weight to this dtype before hashing (default: the dtype the engine holds them in)."""


class SuccessResponse(BaseModel):
    """SGLang's answer to control calls: 200 with success true, or 400 with success false."""

    success: bool
    message: str


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
