"""The interface between the scheduler and what computes tokens, and `make_runner` that picks one.

A runner turns a batch of `ForwardItem`s (new tokens of several sequences) into `ForwardResult`s: the next token
sampled for each sequence that asks, its logprobs, and the logprobs of prompt tokens when asked. It also owns
the sequences' KV storage (opaque to the scheduler), the experts each fed token was routed to (MoE models) and
weight loading:

- `TorchRunner` (torch_runner.py): the real transformer from miles.model;
- `FakeRunner` (fake_runner.py): a deterministic hash-based sampler with a configurable cost per token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

from miles.engine.adapters import AdapterLimits
from miles.engine.requests import Sequence, TokenLogprobs
from miles.engine.settings import EngineSettings


@dataclass(frozen=True)
class ForwardItem:
    """Feed `token_ids` of `seq` at positions [start_pos, start_pos + len). With `sample`, draw the next token
    from the last position. With `input_logprob_from` = a, also return the logprobs of the tokens at positions
    a+1 .. start_pos+len-1, each given the tokens before it (a >= start_pos)."""

    seq: Sequence
    token_ids: list[int]
    start_pos: int
    sample: bool
    input_logprob_from: int | None = None


@dataclass(frozen=True)
class ForwardResult:
    next_token: TokenLogprobs | None
    input_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class Checksum:
    """The served weights' content address in one dtype (see checksum.py)."""

    dtype: str
    digest: str
    exact: bool
    """Whether converting the weights to `dtype` lost nothing."""
    num_tensors: int


@dataclass(frozen=True)
class ModelInfo:
    """What the engine reports about the model it serves."""

    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    num_moe_layers: int = 0
    """Sparse (MoE) decoder layers: the layer axis of routed-expert arrays (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to per MoE layer (top-k): the last axis of routed-expert arrays."""
    num_experts: int = 0
    """Routed experts per MoE layer: expert ids lie in [0, num_experts)."""


class Runner(Protocol):
    info: ModelInfo
    device: str
    """Where the runner computes and keeps KV and weights: "cpu" or "cuda:N" (reported by /server_info)."""
    max_update_bytes: int
    """The most bytes one /update_weights_from_distributed may announce (enough for every weight in float64)."""

    def warmup(self) -> None:
        """Run each code path once so that the first request does not pay for lazy initialisation."""

    def new_kv(self, capacity: int, prefix_blocks: Seq[Any]) -> Any:
        """Storage for a sequence of up to `capacity` tokens, its first positions copied from `prefix_blocks`."""

    def export_kv(self, kv: Any, start: int, end: int) -> Any:
        """A copy of positions [start, end) for the prefix cache (a KVBlock, or None when nothing is stored)."""

    def forward(self, items: list[ForwardItem]) -> list[ForwardResult]: ...

    def routed_experts(self, seq: Sequence, start: int, end: int) -> bytes:
        """The experts positions [start, end) of `seq` were routed to when they were fed through the model, as
        little-endian int32 of shape (end - start, num_moe_layers, num_experts_per_tok) (SGLang's
        `routed_experts` before base64); every position below `end` has been fed. Scheduler thread, before the
        sequence's KV is released."""

    def prepare_weights_from_disk(self, model_path: str) -> Any:
        """Read and validate a checkpoint directory (off the scheduler thread); raises WeightUpdateError."""

    def prepare_weights_from_tensors(self, payloads: list[bytes]) -> Any:
        """Decode and validate named tensors (safetensors bytes; any subset of the weights)."""

    def prepare_weights_from_named(self, tensors: dict[str, Any]) -> Any:
        """Validate received tensors (on the CPU or on this runner's device) by Hugging Face name (any subset of
        the weights); raises WeightUpdateError."""

    def apply_weights(self, prepared: Any) -> None:
        """Swap the prepared weights in (scheduler thread, between steps)."""

    def snapshot_weights(self) -> Any:
        """A copy of the served weights (scheduler thread, between steps: never half-updated); raises
        WeightsCheckError when the runner holds none."""

    def weights_checksum(self, snapshot: Any, dtype: str | None) -> Checksum:
        """The checksum of a snapshot, each weight converted to `dtype` (None: as held); off the scheduler."""

    def prepare_adapter(self, lora_path: str, limits: AdapterLimits) -> Any:
        """Read and check a Hugging Face PEFT LoRA directory for this model (off the scheduler thread); raises
        LoraError when it does not fit."""

    def add_adapter(self, lora_id: str, prepared: Any) -> None:
        """Serve the prepared adapter as `lora_id` to sequences whose `lora_id` names it (scheduler thread)."""

    def remove_adapter(self, lora_id: str) -> None:
        """Forget `lora_id` (scheduler thread; no sequence of it is running)."""


def make_runner(settings: EngineSettings, num_regular_tokens: int) -> Runner:
    """The fake runner for --fake-model (torch never imported), else the torch transformer."""
    if settings.fake_model:
        from miles.engine.fake_runner import FakeRunner

        return FakeRunner(settings, num_regular_tokens)
    from miles.engine.torch_runner import TorchRunner

    return TorchRunner(settings)
