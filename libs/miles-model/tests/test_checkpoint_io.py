"""Weights load from Hugging Face safetensors directories and named-tensor payloads, all or nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from miles.model import (
    CausalLM,
    ModelConfig,
    UnsupportedModelError,
    WeightsError,
    decode_safetensors_bytes,
    encode_safetensors_bytes,
    init_random_weights,
    load_model,
    load_named_tensors,
    read_safetensors_dir,
    save_weights,
)


def _state(model: CausalLM) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_saved_weights_reload_identically_and_tied_lm_head_is_ignored(qwen3_dir: Path, tmp_path: Path) -> None:
    model = load_model(qwen3_dir)
    assert model.lm_head is None
    init_random_weights(model, seed=3, std=0.1)
    save_weights(model, tmp_path)
    (tmp_path / "config.json").write_text((qwen3_dir / "config.json").read_text())
    reloaded = load_model(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(_state(model).values(), _state(reloaded).values(), strict=True))
    extra = {"lm_head.weight": torch.zeros(1), "model.rotary_emb.inv_freq": torch.zeros(1)}
    assert load_named_tensors(reloaded, extra, require_all=False) == 0


def test_sharded_directory_with_index_and_bfloat16_weights(qwen3_dir: Path, tmp_path: Path) -> None:
    tensors = read_safetensors_dir(qwen3_dir)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file_name, shard_names in shards.items():
        save_file({n: tensors[n].to(torch.bfloat16) for n in shard_names}, str(tmp_path / file_name))
    weight_map = {n: f for f, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((qwen3_dir / "config.json").read_text())
    model = load_model(tmp_path)
    expected = tensors["model.norm.weight"].to(torch.bfloat16).to(torch.float32)
    assert torch.equal(model.model.norm.weight.detach(), expected)


def test_bad_updates_change_nothing(qwen3_dir: Path) -> None:
    model = load_model(qwen3_dir)
    before = _state(model)
    good = torch.ones_like(before["model.norm.weight"])
    with pytest.raises(WeightsError, match="unknown tensor name"):
        load_named_tensors(model, {"model.norm.weight": good, "model.nope": good}, require_all=False)
    with pytest.raises(WeightsError, match="shape"):
        load_named_tensors(model, {"model.norm.weight": torch.ones(3)}, require_all=False)
    with pytest.raises(WeightsError, match="missing"):
        load_named_tensors(model, {"model.norm.weight": good}, require_all=True)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert load_named_tensors(model, {"model.norm.weight": good}, require_all=False) == 1
    assert torch.equal(model.model.norm.weight.detach(), good)


def test_named_tensor_payload_roundtrip_and_garbage() -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    decoded = decode_safetensors_bytes(encode_safetensors_bytes(tensors))
    assert all(torch.equal(decoded[k], v) for k, v in tensors.items())
    with pytest.raises(WeightsError):
        decode_safetensors_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")


def test_unsupported_architectures_are_refused() -> None:
    base = {"model_type": "qwen3", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8}
    base |= {"num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelConfig.from_dict(base).num_key_value_heads == 2
    with pytest.raises(UnsupportedModelError, match="model_type"):
        ModelConfig.from_dict({**base, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="sliding"):
        ModelConfig.from_dict({**base, "use_sliding_window": True})
