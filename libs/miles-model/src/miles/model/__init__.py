"""Torch model code shared by the miles engine and trainer: Hugging Face checkpoints, the transformer forward
(fast and deterministic shape-invariant modes; dense Llama-family models and Qwen3-MoE with routing replay), KV
caches and logprob computation.

Typical use:

    from miles.model import load_model, sequence_logprobs
    model = load_model("path/to/hf-checkpoint")
    logprobs = sequence_logprobs(model, input_ids, start=prompt_len, deterministic=True)
"""

from miles.model.checkpoint import (
    check_named_tensors,
    decode_safetensors_bytes,
    encode_safetensors_bytes,
    load_model,
    load_named_tensors,
    read_safetensors_dir,
    save_weights,
)
from miles.model.config import ModelConfig
from miles.model.errors import ModelError, UnsupportedModelError, WeightsError
from miles.model.init import init_random_weights
from miles.model.kernels import DETERMINISTIC_BLOCK_ROWS, single_threaded
from miles.model.kv_cache import KVBlock, SequenceKV
from miles.model.logprobs import block_logprobs, row_blocks, sequence_logprobs, target_logprobs
from miles.model.moe import check_routed_experts
from miles.model.transformer import CausalLM, ForwardOutput, Segment
from miles.model.update_group import UPDATE_GROUP_BACKENDS, init_custom_process_group

__all__ = [
    "DETERMINISTIC_BLOCK_ROWS",
    "UPDATE_GROUP_BACKENDS",
    "CausalLM",
    "ForwardOutput",
    "KVBlock",
    "ModelConfig",
    "ModelError",
    "Segment",
    "SequenceKV",
    "UnsupportedModelError",
    "WeightsError",
    "block_logprobs",
    "check_named_tensors",
    "check_routed_experts",
    "decode_safetensors_bytes",
    "encode_safetensors_bytes",
    "init_custom_process_group",
    "init_random_weights",
    "load_model",
    "load_named_tensors",
    "read_safetensors_dir",
    "row_blocks",
    "save_weights",
    "sequence_logprobs",
    "single_threaded",
    "target_logprobs",
]
