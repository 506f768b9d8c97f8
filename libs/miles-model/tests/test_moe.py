"""Qwen3-MoE: the same logits and routing as Hugging Face, Hub and transformers-5 weight names, routing replay
(R3) that reproduces the free forward bit for bit and trains the router, routing kept in KV caches, and replay
arrays that do not fit refused. Batch invariance is pinned with the dense model in
test_deterministic_invariance.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from miles.model import (
    CausalLM,
    KVBlock,
    ModelConfig,
    Segment,
    SequenceKV,
    UnsupportedModelError,
    WeightsError,
    load_model,
    load_named_tensors,
    save_weights,
    sequence_logprobs,
)

_BASE = {
    "model_type": "qwen3_moe",
    "vocab_size": 8,
    "hidden_size": 8,
    "intermediate_size": 8,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
}


@pytest.fixture(scope="module")
def model(qwen3_moe_dir: Path) -> CausalLM:
    return load_model(qwen3_moe_dir)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_config_reads_hub_and_transformers_5_names_and_picks_sparse_layers() -> None:
    hub = ModelConfig.from_dict({**_BASE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 4})
    assert (hub.num_experts, hub.num_experts_per_tok, hub.moe_intermediate_size) == (8, 2, 4)
    assert hub.moe_layer_indices == (0, 1, 2, 3) and not hub.norm_topk_prob
    v5 = {**_BASE, "num_local_experts": 6, "num_experts_per_tok": 3, "mlp_only_layers": [0, 2], "norm_topk_prob": True}
    parsed = ModelConfig.from_dict(v5)
    assert parsed.num_experts == 6 and parsed.moe_layer_indices == (1, 3) and parsed.norm_topk_prob
    stepped = ModelConfig.from_dict({**_BASE, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2})
    assert stepped.moe_layer_indices == (1, 3) and stepped.num_moe_layers == 2
    dense = ModelConfig.from_dict({**_BASE, "model_type": "qwen3"})
    assert dense.num_moe_layers == 0 and dense.num_experts == 0
    defaults = ModelConfig.from_dict(_BASE)  # Qwen3MoeConfig's: 128 experts, top-8, width 768
    assert (defaults.num_experts, defaults.num_experts_per_tok, defaults.moe_intermediate_size) == (128, 8, 768)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({**_BASE, "model_type": "mixtral", "num_local_experts": 8}, "model_type 'mixtral' is not supported"),
        ({**_BASE, "model_type": "deepseek_v3", "n_routed_experts": 8}, "only MoE architecture implemented"),
        ({**_BASE, "model_type": "qwen2_moe", "num_experts": 8}, "mixture-of-experts model_type 'qwen2_moe'"),
        ({**_BASE, "model_type": "qwen3", "num_experts": 8}, "mixture-of-experts layers in model_type 'qwen3'"),
        ({**_BASE, "num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok 5"),
        ({**_BASE, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 0}, "decoder_sparse_step"),
    ],
)
def test_other_moe_architectures_and_bad_moe_configs_are_refused(raw: dict[str, object], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict(raw)


@pytest.fixture(scope="module")
def stepped_moe_dir(tmp_path_factory: pytest.TempPathFactory, checkpoint_writer: Callable[..., Path]) -> Path:
    """Sparse layers 1 and 3 (decoder_sparse_step 2), no renormalisation, untied LM head."""
    overrides = {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False}
    return checkpoint_writer(tmp_path_factory.mktemp("stepped"), "qwen3_moe", **overrides)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("variant", ["qwen3_moe_dir", "stepped_moe_dir"])
def test_logits_and_routing_match_hugging_face(
    request: pytest.FixtureRequest, variant: str, deterministic: bool
) -> None:
    model_dir: Path = request.getfixturevalue(variant)
    ids = _ids(48, 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_model(model_dir)
    with torch.no_grad():
        expected = hf(ids[None], output_router_logits=True)
        out = ours.forward_routed([Segment(ids)], deterministic=deterministic)
        logits = torch.nn.functional.linear(out.hidden, ours.lm_head_weight)
        logprobs = sequence_logprobs(ours, ids, start=1, deterministic=deterministic)
    assert torch.allclose(logits, expected.logits[0], atol=2e-5, rtol=1e-5), (logits - expected.logits[0]).abs().max()
    hf_logprobs = torch.log_softmax(expected.logits[0], -1)[:-1].gather(1, ids[1:, None])[:, 0]
    assert torch.allclose(logprobs, hf_logprobs, atol=2e-5)
    top_k = ours.config.num_experts_per_tok
    hf_routing = [torch.softmax(r, dim=-1).topk(top_k, dim=-1).indices for r in expected.router_logits]
    assert out.routed_experts.dtype == torch.int32
    assert out.routed_experts.shape == (48, ours.config.num_moe_layers, top_k) == (48, 2, 2)
    assert torch.equal(out.routed_experts, torch.stack(hf_routing, dim=1).to(torch.int32))
    assert len(set(out.routed_experts[:, 0].flatten().tolist())) > top_k  # routing is not trivial


def test_fused_transformers_5_state_dict_loads_and_our_checkpoint_loads_in_hugging_face(
    model: CausalLM, qwen3_moe_dir: Path, tmp_path: Path
) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_moe_dir, dtype=torch.float32).eval()
    fused = hf.state_dict()
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    fresh = CausalLM(model.config)
    load_named_tensors(fresh, fused, require_all=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True))
    save_weights(fresh, tmp_path)
    (tmp_path / "config.json").write_text((qwen3_moe_dir / "config.json").read_text())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _ids(12, 2)
    with torch.no_grad():
        assert torch.equal(reloaded(ids[None]).logits, hf(ids[None]).logits)
    with pytest.raises(WeightsError, match="expected \\(8"):
        load_named_tensors(fresh, {"model.layers.0.mlp.experts.down_proj": torch.zeros(4, 64, 32)}, require_all=False)
    both = {"model.layers.2.mlp.experts.down_proj": fused["model.layers.2.mlp.experts.down_proj"]}
    both["model.layers.2.mlp.experts.1.down_proj.weight"] = torch.zeros(64, 32)
    with pytest.raises(WeightsError, match="both fused and per expert"):
        load_named_tensors(fresh, both, require_all=False)


@pytest.mark.parametrize("deterministic", [False, True])
def test_replaying_the_recorded_routing_reproduces_the_free_forward_bit_for_bit(
    model: CausalLM, deterministic: bool
) -> None:
    ids = _ids(40, 3)
    with torch.no_grad():
        free = model.forward_routed([Segment(ids)], deterministic=deterministic)
        replayed = model.forward_routed([Segment(ids)], deterministic=deterministic, routed_experts=free.routed_experts)
        free_logprobs = sequence_logprobs(model, ids, start=5, deterministic=deterministic)
        # SGLang reports one row fewer than the sequence (its last token is never fed); int64 ids work too
        sglang_rows = free.routed_experts[:-1].to(torch.int64)
        replayed_logprobs = sequence_logprobs(
            model, ids, start=5, deterministic=deterministic, routed_experts=sglang_rows
        )
    assert torch.equal(replayed.hidden, free.hidden)
    assert torch.equal(replayed.routed_experts, free.routed_experts)
    if deterministic:  # dropping the unused last token changes kernel shapes only in the fast path
        assert torch.equal(replayed_logprobs, free_logprobs)
    else:
        assert torch.allclose(replayed_logprobs, free_logprobs, atol=1e-5)


def test_replaying_other_experts_changes_logprobs_and_trains_the_router(model: CausalLM) -> None:
    ids = _ids(30, 4)
    with torch.no_grad():
        free = model.forward_routed([Segment(ids)], deterministic=True)
        free_logprobs = sequence_logprobs(model, ids, start=1, deterministic=True)
    other = (free.routed_experts + 1) % model.config.num_experts
    model.zero_grad()
    replayed = model.forward_routed([Segment(ids)], deterministic=True, routed_experts=other)
    # the router's own choice is still reported: the first MoE layer sees the same input as the free forward
    assert torch.equal(replayed.routed_experts[:, 0], free.routed_experts[:, 0])
    logprobs = sequence_logprobs(model, ids, start=1, deterministic=True, routed_experts=other)
    assert not torch.allclose(logprobs, free_logprobs, atol=1e-3)
    logprobs.sum().backward()
    for index in model.config.moe_layer_indices:
        block = model.model.layers[index].mlp
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
        used = set(other[:, model.config.moe_layer_indices.index(index)].flatten().tolist())
        for expert in range(model.config.num_experts):
            grad = block.experts[expert].up_proj.weight.grad
            assert (grad is not None and grad.abs().sum() > 0) == (expert in used)
    model.zero_grad()


def test_kv_caches_keep_the_routing_of_decoded_tokens_and_prefix_hits(model: CausalLM) -> None:
    ids = _ids(36, 5)
    with torch.no_grad():
        full = model.forward_routed([Segment(ids)], deterministic=True).routed_experts
        kv = SequenceKV.for_config(model.config, 36)
        model.forward_segments([Segment(ids[:20], 0, kv)], deterministic=True)
        for position in range(20, 35):  # decode, batched with an unrelated prefill
            other = Segment(_ids(7, position), 0, SequenceKV.for_config(model.config, 7))
            model.forward_segments([other, Segment(ids[position : position + 1], position, kv)], deterministic=True)
        assert torch.equal(kv.routed_experts(0, 35), full[:35])
        head, _ = kv.export(0, 24).split_at(16)
        assert head.routed_experts is not None and torch.equal(head.routed_experts, full[:16])
        hit = SequenceKV.for_config(model.config, 36)
        hit.load_prefix([head])
        model.forward_segments([Segment(ids[16:], 16, hit)], deterministic=True)
        assert torch.equal(hit.routed_experts(0, 36), full)
    with pytest.raises(ValueError, match="without routed experts"):
        SequenceKV.for_config(model.config, 36).load_prefix([KVBlock(head.keys, head.values)])
    with pytest.raises(ValueError, match="only 36 are filled"):
        hit.routed_experts(0, 37)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda r: r[:, 0], "shape"),
        (lambda r: r[:, :1], r"shape \(10, 1, 2\), expected \(10, 2, 2\)"),
        (lambda r: r[:, :, :1], "shape"),
        (lambda r: r[:9], "shape"),
        (lambda r: r.float(), "integer"),
        (lambda r: torch.full_like(r, 8), r"ids in \[8, 8\], expected \[0, 8\)"),
        (lambda r: torch.cat((r[:1] * 0 - 1, r[1:])), r"ids in \[-1"),
        (lambda r: torch.zeros_like(r), "repeats an expert"),
    ],
)
def test_replay_arrays_that_do_not_fit_are_refused(
    model: CausalLM, make: Callable[[torch.Tensor], torch.Tensor], message: str
) -> None:
    ids = _ids(10, 6)
    with torch.no_grad():
        recorded = model.forward_routed([Segment(ids)]).routed_experts
        with pytest.raises(ValueError, match=message):
            model.forward_routed([Segment(ids)], routed_experts=make(recorded))


def test_dense_models_record_empty_routing_and_refuse_replay(qwen3_dir: Path) -> None:
    dense = load_model(qwen3_dir)
    ids = _ids(6, 7)
    with torch.no_grad():
        out = dense.forward_routed([Segment(ids)])
        assert out.routed_experts.shape == (6, 0, 0)
        with pytest.raises(ValueError, match="no MoE layers"):
            dense(ids, routed_experts=torch.zeros((6, 1, 1), dtype=torch.int32))
    assert not SequenceKV.for_config(dense.config, 4).stores_routing
