"""The pieces of the multi-rank Megatron backend that need no second process: the layout checks (settings and
model), how global tensors are cut into TP shards and put back together (fused qkv by kv group, fc1 [gate; up]
halves, row-parallel, padded vocabulary), and the per-name HF -> Megatron builder every rank loads its shards with.
The 2-process runs are in test_trainer_megatron_parallel.py."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from miles.common.errors import ConfigError
from miles.model import ModelConfig
from miles.trainer.backends.megatron_mapping import AttentionLayout, hf_to_megatron, megatron_tensor, split_qkv
from miles.trainer.backends.megatron_parallel import ParallelSizes, check_layout
from miles.trainer.backends.megatron_shards import ShardSpec, merge_shards, shard_of
from miles.trainer.settings import TrainerSettings


def _config(**overrides: object) -> ModelConfig:
    from miles.engine.tiny_model import TINY_QWEN3_CONFIG, TINY_QWEN3_MOE_CONFIG

    base = TINY_QWEN3_MOE_CONFIG if overrides.pop("moe", False) else TINY_QWEN3_CONFIG
    return ModelConfig.from_dict({**base, **overrides})


@pytest.mark.parametrize(
    ("sizes", "world_size", "overrides", "message"),
    [
        (ParallelSizes(tp=4), 4, {"num_key_value_heads": 2}, "num_key_value_heads 2 is not divisible by tp_size 4"),
        (ParallelSizes(tp=3), 3, {}, "num_attention_heads 4 is not divisible by tp_size 3"),
        (ParallelSizes(pp=3), 3, {}, "num_hidden_layers 4 is not divisible by pp_size 3"),
        (ParallelSizes(tp=2), 3, {}, "world_size 3 is not divisible by tp_size x pp_size = 2 x 1"),
        (ParallelSizes(ep=2), 2, {}, "ep_size 2 needs a mixture-of-experts model"),
        (ParallelSizes(ep=3), 3, {"moe": True}, "num_experts 8 is not divisible by ep_size 3"),
        (ParallelSizes(tp=2, ep=2), 2, {"moe": True}, "ep_size 2 must divide the data-parallel size 1"),
        (ParallelSizes(pp=2), 2, {"moe": True}, "tp_size and pp_size must be 1 for a mixture-of-experts model"),
    ],
)
def test_layouts_that_do_not_fit_the_model_are_refused_naming_why(
    sizes: ParallelSizes, world_size: int, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        check_layout(_config(**overrides), sizes, world_size)
    assert refused.value.field == "megatron"


def test_layouts_that_fit_pass_and_data_parallel_is_the_rest_of_the_world() -> None:
    check_layout(_config(), ParallelSizes(tp=2, pp=2), 8)
    check_layout(_config(moe=True), ParallelSizes(ep=4), 8)
    assert ParallelSizes(tp=2, pp=2).data_parallel_size(8) == 2


def test_settings_refuse_a_world_size_the_parallel_sizes_do_not_divide() -> None:
    TrainerSettings(backend="megatron", world_size=8, megatron={"tp_size": 2, "pp_size": 2, "ep_size": 2})
    with pytest.raises(ValidationError, match="world_size 6 is not divisible by tp_size x pp_size = 2 x 2"):
        TrainerSettings(backend="megatron", world_size=6, megatron={"tp_size": 2, "pp_size": 2})
    with pytest.raises(ValidationError, match="ep_size 4 must divide the data-parallel size 2"):
        TrainerSettings(backend="megatron", world_size=4, megatron={"tp_size": 2, "ep_size": 4})
    with pytest.raises(ValidationError, match="apply to the megatron backend only"):
        TrainerSettings(backend="torch", world_size=2, megatron={"tp_size": 2})


def _spec(dim: int | None, rank: int, *, glu: bool = False, vocab_size: int | None = None) -> ShardSpec:
    return ShardSpec(
        global_name="x",
        source_name="x",
        dim=dim,
        group_rank=rank,
        group_size=2,
        glu=glu,
        vocab_size=vocab_size,
        expert=False,
        primary=True,
        exported=True,
        counted=True,
    )


def test_fused_qkv_splits_into_whole_kv_groups_per_tensor_parallel_rank() -> None:
    layout = AttentionLayout(num_heads=4, num_kv_heads=2, head_dim=1)
    q, k, v = (
        torch.tensor([[10.0], [11.0], [12.0], [13.0]]),
        torch.tensor([[20.0], [21.0]]),
        torch.tensor([[30.0], [31.0]]),
    )
    tensors = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k}
    tensors["model.layers.0.self_attn.v_proj.weight"] = v
    fused = megatron_tensor("decoder.layers.0.self_attention.linear_qkv.weight", tensors.__getitem__, layout)
    shards = [shard_of(fused, _spec(0, rank), (4, 1)) for rank in (0, 1)]
    # Rank r holds kv group r whole: its query heads, then its key and value head (megatron's local layout).
    assert shards[0][:, 0].tolist() == [10, 11, 20, 30] and shards[1][:, 0].tolist() == [12, 13, 21, 31]
    half = AttentionLayout(num_heads=2, num_kv_heads=1, head_dim=1)
    assert [t[:, 0].tolist() for t in split_qkv(shards[1], half)] == [[12, 13], [21], [31]]
    assert torch.equal(merge_shards(shards, _spec(0, 0)), fused)


def test_fc1_is_split_into_gate_and_up_halves_and_merged_back() -> None:
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    fc1 = torch.cat([gate, up])
    shards = [shard_of(fc1, _spec(0, rank, glu=True), (4, 2)) for rank in (0, 1)]
    assert torch.equal(shards[1], torch.cat([gate[2:], up[2:]]))  # [gate_1; up_1], not rows 4..7 of [gate; up]
    assert torch.equal(merge_shards(shards, _spec(0, 0, glu=True)), fc1)


def test_row_parallel_and_replicated_tensors_round_trip() -> None:
    proj = torch.arange(24.0).reshape(4, 6)
    shards = [shard_of(proj, _spec(1, rank), (4, 3)) for rank in (0, 1)]
    assert torch.equal(shards[0], proj[:, :3]) and torch.equal(merge_shards(shards, _spec(1, 0)), proj)
    norm = torch.arange(4.0)
    assert shard_of(norm, _spec(None, 1), (4,)) is norm and torch.equal(merge_shards([norm], _spec(None, 0)), norm)


def test_an_odd_vocabulary_is_padded_with_zero_rows_and_cut_back() -> None:
    embedding = torch.arange(1.0, 11.0).reshape(5, 2)  # 5 tokens over TP = 2: 3 rows per rank, one of them padding
    shards = [shard_of(embedding, _spec(0, rank, vocab_size=5), (3, 2)) for rank in (0, 1)]
    assert torch.equal(shards[1], torch.tensor([[7.0, 8.0], [9.0, 10.0], [0.0, 0.0]]))
    assert torch.equal(merge_shards(shards, _spec(0, 0, vocab_size=5)), embedding)


def test_every_megatron_tensor_built_by_name_equals_the_whole_state_dict_mapping() -> None:
    """What each rank reads for its shards (`megatron_tensor`) is exactly what `hf_to_megatron` maps, for a
    Qwen3-MoE layer, a dense layer and the untied output layer."""
    layout = AttentionLayout(num_heads=4, num_kv_heads=2, head_dim=8)
    generator = torch.Generator().manual_seed(0)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (50, 16),
        "model.norm.weight": (16,),
        "lm_head.weight": (50, 16),
    }
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (16,), p + "post_attention_layernorm.weight": (16,)}
        shapes |= {p + f"self_attn.{n}_proj.weight": (32 if n == "q" else 16, 16) for n in "qkv"}
        shapes |= {p + f"self_attn.{n}_proj.bias": (32 if n == "q" else 16,) for n in "qkv"}
        shapes |= {p + "self_attn.o_proj.weight": (16, 32), p + "self_attn.q_norm.weight": (8,)}
        shapes |= {p + "self_attn.k_norm.weight": (8,)}
    shapes |= {"model.layers.0.mlp.gate.weight": (4, 16)}
    for e in range(4):
        expert = f"model.layers.0.mlp.experts.{e}."
        shapes |= {expert + "gate_proj.weight": (12, 16), expert + "up_proj.weight": (12, 16)}
        shapes |= {expert + "down_proj.weight": (16, 12)}
    shapes |= {f"model.layers.1.mlp.{n}.weight": (24, 16) for n in ("gate_proj", "up_proj")}
    shapes["model.layers.1.mlp.down_proj.weight"] = (16, 24)
    tensors = {name: torch.randn(*shape, generator=generator) for name, shape in shapes.items()}
    mapped = hf_to_megatron(tensors, layout, 2, tied=False)
    assert len(mapped) == 3 + 2 * 7 + (1 + 4 * 2) + 2  # top, attention+norms per layer, MoE layer 0, dense 1
    for name, expected in mapped.items():
        assert torch.equal(megatron_tensor(name, tensors.__getitem__, layout), expected), name
    with pytest.raises(KeyError, match="no Hugging Face source"):
        megatron_tensor("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", tensors.__getitem__, layout)
