"""Request bodies of the engine's HTTP API: SGLang's native protocol (SGLang 0.5.x / HEAD field names).

Unknown keys are ignored, as SGLang's /generate does (e.g. "model"). Fields SGLang has but this engine does not
implement are declared so that a request using them is refused with a 400 instead of silently misread.
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


class UpdateWeightVersionBody(_Body):
    new_version: str
    abort_all_requests: bool = True


class MemoryOccupationBody(_Body):
    tags: list[str] | None = None
