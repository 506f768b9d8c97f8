"""Our forward equals Hugging Face's on the same checkpoint (fast path closely, deterministic path within float
rounding), for Qwen3 and the other supported families."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from miles.model import SequenceKV, load_model, sequence_logprobs
from miles.model.kernels import single_threaded
from miles.model.transformer import Segment


def _hf_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0]


def _our_logits(model_dir: Path, ids: torch.Tensor, deterministic: bool) -> torch.Tensor:
    model = load_model(model_dir)
    with torch.no_grad():
        hidden = model(ids, deterministic=deterministic)
        return torch.nn.functional.linear(hidden, model.lm_head_weight)


@pytest.mark.parametrize("deterministic", [False, True])
def test_qwen3_logits_match_hugging_face(qwen3_dir: Path, deterministic: bool) -> None:
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(1))
    expected = _hf_logits(qwen3_dir, ids)
    actual = _our_logits(qwen3_dir, ids, deterministic)
    assert torch.allclose(actual, expected, atol=2e-5, rtol=1e-5), (actual - expected).abs().max()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_other_families_match_hugging_face(tmp_path: Path, family: str, checkpoint_writer: Callable[..., Path]) -> None:
    model_dir = checkpoint_writer(tmp_path, family)
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(2))
    expected = _hf_logits(model_dir, ids)
    actual = _our_logits(model_dir, ids, deterministic=False)
    assert torch.allclose(actual, expected, atol=2e-5, rtol=1e-5), (actual - expected).abs().max()


def test_kv_cache_decode_matches_full_forward_in_fast_mode(qwen3_dir: Path) -> None:
    model = load_model(qwen3_dir)
    c = model.config
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(3))
    kv = SequenceKV(c.num_hidden_layers, 32, c.num_key_value_heads, c.head_dim)
    with torch.no_grad():
        full = model(ids)
        parts = [model.forward_segments([Segment(ids[:7], 0, kv)])]
        parts.append(model.forward_segments([Segment(ids[7:12], 7, kv)]))
        parts += [model.forward_segments([Segment(ids[t : t + 1], t, kv)]) for t in range(12, 20)]
    assert torch.allclose(torch.cat(parts), full, atol=1e-5)


def test_sequence_logprobs_match_hugging_face_log_softmax(qwen3_dir: Path) -> None:
    ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(4))
    expected = torch.log_softmax(_hf_logits(qwen3_dir, ids), dim=-1)[:-1].gather(1, ids[1:, None])[:, 0]
    with single_threaded(), torch.no_grad():
        actual = sequence_logprobs(load_model(qwen3_dir), ids, start=1)
    assert torch.allclose(actual, expected, atol=2e-5)
