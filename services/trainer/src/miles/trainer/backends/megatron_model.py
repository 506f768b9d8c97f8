"""The megatron-core GPTModel of a Hugging Face config, as one rank builds it: its pipeline stage, its experts
and its tensor-parallel slices (the whole model at world_size 1).

Local layer spec (no Transformer Engine), RMSNorm, gated SiLU MLP, RoPE, optional q/k norm and qkv bias, MoE layers
from `megatron_moe.py`. Logits are gathered over TP (`parallel_output=False`) and the vocabulary is padded to a
multiple of TP (megatron's vocab-parallel layers split it evenly; the backend cuts the logits back). Tied
embeddings across pipeline stages use megatron's scheme of a separate copy on the last stage, kept equal by the
backend (`megatron_shards.py`, `megatron_schedule.py`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from miles.common.jobspec.trainer import TrainConfig
from miles.model import ModelConfig
from miles.trainer.backends.base import resolve_routing_replay
from miles.trainer.backends.megatron_moe import decoder_block_spec, moe_config_fields
from miles.trainer.backends.megatron_parallel import ParallelSizes, RankLayout
from miles.trainer.backends.torch_routing import model_routing_shape


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of TP (megatron's vocab-parallel layers split it evenly)."""
    return -(-vocab_size // tp) * tp


def _parallel_fields(config: ModelConfig, sizes: ParallelSizes) -> dict[str, Any]:
    """TransformerConfig fields of the layout beyond the TP and PP sizes."""
    parallel: dict[str, Any] = {}
    if sizes.pp > 1:  # activations of every micro-batch's own shape travel between stages, float32
        parallel = {"pipeline_dtype": torch.float32, "variable_seq_lengths": True, "batch_p2p_sync": False}
        parallel["calculate_per_token_loss"] = True  # megatron must not rescale the trainer's loss
        if not config.num_moe_layers:  # megatron refuses variable lengths with its default (allgather) dispatcher
            parallel["moe_token_dispatcher_type"] = "alltoall"  # unused: no MoE layer (PP is refused for MoE)
    if sizes.ep > 1:
        parallel["expert_model_parallel_size"] = sizes.ep
    return parallel


def build_gpt_model(config: ModelConfig, train: TrainConfig, layout: RankLayout | None = None) -> Any:
    """This rank's GPTModel (its pipeline stage, experts and TP slices; the whole model without a layout) with the
    architecture of `config` (weights uninitialised until loaded); MoE layers replay recorded routing when
    `train.routing_replay` resolves to on."""
    from megatron.core.models.gpt import GPTModel  # type: ignore[import-untyped]
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # type: ignore[import-untyped]
    from megatron.core.transformer.transformer_config import TransformerConfig  # type: ignore[import-untyped]

    sizes = layout.sizes if layout is not None else ParallelSizes()
    parallel = _parallel_fields(config, sizes)
    on_gpu = torch.cuda.is_available()
    recompute: dict[str, Any] = {}
    if train.gradient_checkpointing:
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    transformer_config = TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        ffn_hidden_size=config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        qk_layernorm=config.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=config.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not on_gpu,
        params_dtype=torch.float32,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        **parallel,
        **recompute,
        **moe_config_fields(config, replay=resolve_routing_replay(train, model_routing_shape(config))),
    )
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_norm, normalization="RMSNorm")
    return GPTModel(
        config=transformer_config,
        transformer_layer_spec=decoder_block_spec(config, layer_spec) if config.num_moe_layers else layer_spec,
        vocab_size=padded_vocab_size(config.vocab_size, sizes.tp),
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(config.rope_theta),
        # Tied across stages: the last stage keeps its own copy, kept equal by summed gradients (megatron_shards).
        share_embeddings_and_output_weights=config.tie_word_embeddings and sizes.pp == 1,
        pre_process=layout is None or layout.first_stage,
        post_process=layout is None or layout.last_stage,
        parallel_output=False,  # logits gathered over TP: every TP rank computes the same loss
    )
