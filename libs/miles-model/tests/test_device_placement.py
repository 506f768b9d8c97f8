"""Every tensor a forward creates lives on the model's device (what an engine or trainer on a GPU needs), checked on
the CPU with torch's `meta` device: a meta model mixed with any CPU tensor (an attention mask, a temperature
vector, a KV buffer built on the CPU) raises "Tensor on device cpu is not on the expected device meta", exactly
as a CUDA model would raise for it. Meta tensors carry shapes only, so paths that read values back
(MoE expert counts, `.tolist()`) are not covered here; the `gpu`-marked engine tests run those on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.model import CausalLM, ModelConfig, Segment, SequenceKV, sequence_logprobs, target_logprobs

META = torch.device("meta")


@pytest.fixture(scope="module")
def meta_model(qwen3_dir: Path) -> CausalLM:
    return CausalLM(ModelConfig.from_dir(qwen3_dir)).to(META)


def test_sequence_kv_for_config_places_keys_values_and_routing_on_the_given_device(qwen3_moe_dir: Path) -> None:
    config = ModelConfig.from_dir(qwen3_moe_dir)
    kv = SequenceKV.for_config(config, 8, device=META)
    kv.write(0, 0, *[torch.zeros(3, config.num_key_value_heads, config.head_dim, device=META)] * 2)
    assert kv.keys(0, 3).device == META and kv.values(0, 3).device == META
    assert kv.stores_routing
    kv.write_routing(0, 0, torch.zeros(3, config.num_experts_per_tok, dtype=torch.int32, device=META))
    assert kv.routed_experts(0, 0).device == META
    default = SequenceKV.for_config(config, 8)
    assert default.keys(0, 1).device.type == "cpu"  # the CPU stays the default


@pytest.mark.parametrize("deterministic", [False, True])
def test_forward_with_a_kv_cache_keeps_every_tensor_on_the_models_device(
    meta_model: CausalLM, deterministic: bool
) -> None:
    """A prefill, a multi-token prefill on top of the cache (the fast path's explicit mask) and a decode."""
    kv = SequenceKV.for_config(meta_model.config, 16, device=META)
    for ids, start in (([1, 2, 3], 0), ([4, 5, 6], 3), ([7], 6)):
        segment = Segment(torch.tensor(ids, device=META), start, kv)
        hidden = meta_model.forward_segments([segment], deterministic=deterministic)
        assert hidden.device == META and hidden.shape == (len(ids), meta_model.config.hidden_size)
    block = kv.export(0, 7)
    assert block.keys.device == META
    follower = SequenceKV.for_config(meta_model.config, 16, device=META)
    follower.load_prefix([block])
    assert follower.length == 7


@pytest.mark.parametrize("deterministic", [False, True])
def test_sequence_logprobs_with_a_float_temperature_stay_on_the_models_device(
    meta_model: CausalLM, deterministic: bool
) -> None:
    ids = torch.tensor([1, 2, 3, 4, 5], device=META)
    logprobs = sequence_logprobs(meta_model, ids, start=2, temperature=0.7, deterministic=deterministic)
    assert logprobs.device == META and logprobs.shape == (3,)
    hidden = torch.zeros(2, meta_model.config.hidden_size, device=META)
    assert target_logprobs(meta_model, hidden, torch.tensor([1, 2], device=META), 1.0).device == META
