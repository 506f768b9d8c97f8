"""Deterministic mode: a token's logprob is the same bits however the sequence was computed — one full forward
(the trainer), prefill then single-token decode against a KV cache (the engine), batched with any other
sequences, split into any segments — and the full forward stays differentiable. Every test runs on the dense
Qwen3 model and on the Qwen3-MoE one (where the other sequences of a batch route tokens to the same experts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.model import (
    DETERMINISTIC_BLOCK_ROWS,
    CausalLM,
    Segment,
    SequenceKV,
    block_logprobs,
    load_model,
    sequence_logprobs,
    target_logprobs,
)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def model(request: pytest.FixtureRequest) -> CausalLM:
    model_dir: Path = request.getfixturevalue(f"{request.param}_dir")
    return load_model(model_dir)


def _kv(model: CausalLM, capacity: int) -> SequenceKV:
    return SequenceKV.for_config(model.config, capacity)


def _random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _incremental_logprobs(model: CausalLM, ids: torch.Tensor, prompt_len: int, seed: int) -> torch.Tensor:
    """Prefill the prompt, then feed one token at a time, each step batched with 0-40 random other rows."""
    rng = torch.Generator().manual_seed(seed)
    kv = _kv(model, len(ids))
    hidden = [model.forward_segments([Segment(ids[:prompt_len], 0, kv)], deterministic=True)[-1:]]
    for position in range(prompt_len, len(ids) - 1):
        others = []
        for _ in range(int(torch.randint(0, 4, (1,), generator=rng))):
            n = int(torch.randint(1, 12, (1,), generator=rng))
            others.append(Segment(torch.randint(0, 512, (n,), generator=rng), 0, _kv(model, n)))
        mine = Segment(ids[position : position + 1], position, kv)
        slot = int(torch.randint(0, len(others) + 1, (1,), generator=rng))
        segments = [*others[:slot], mine, *others[slot:]]
        out = model.forward_segments(segments, deterministic=True)
        row = sum(len(s.input_ids) for s in segments[:slot])
        hidden.append(out[row : row + 1])
    # the logprob rows are also read in blocks mixed with unrelated rows
    rows = torch.cat(hidden)
    noise = torch.randn((7, rows.shape[1]), generator=rng)
    mixed = torch.cat((noise[:3], rows, noise[3:]))
    targets = torch.cat((torch.zeros(3, dtype=torch.long), ids[prompt_len:], torch.zeros(4, dtype=torch.long)))
    return target_logprobs(model, mixed, targets, deterministic=True)[3 : 3 + len(rows)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_batched_decode_equals_full_forward_bit_for_bit(model: CausalLM, seed: int) -> None:
    ids = _random_ids(70, seed)
    prompt_len = 9 + seed * 11
    with torch.no_grad():
        full = sequence_logprobs(model, ids, start=prompt_len, deterministic=True)
        incremental = _incremental_logprobs(model, ids, prompt_len, seed)
    assert torch.equal(full, incremental)


def test_prefix_cache_copy_and_uneven_segments_give_the_same_bits(model: CausalLM) -> None:
    ids = _random_ids(80, 5)
    with torch.no_grad():
        full = model(ids, deterministic=True)
        first = _kv(model, 80)
        model.forward_segments([Segment(ids[:45], 0, first)], deterministic=True)
        second = _kv(model, 80)
        second.load_prefix([first.export(0, 30)])
        tail = model.forward_segments([Segment(ids[30:80], 30, second)], deterministic=True)
    assert torch.equal(tail, full[30:])


def test_logprob_blocks_do_not_depend_on_the_other_rows(model: CausalLM) -> None:
    rows = torch.randn((DETERMINISTIC_BLOCK_ROWS, model.config.hidden_size), generator=torch.Generator().manual_seed(7))
    temperatures = torch.linspace(0.5, 1.5, DETERMINISTIC_BLOCK_ROWS)
    together = block_logprobs(model, rows, temperatures, deterministic=True)
    for i in (0, 5, DETERMINISTIC_BLOCK_ROWS - 1):
        alone = block_logprobs(model, rows[i : i + 1], temperatures[i : i + 1], deterministic=True)
        assert torch.equal(alone[0], together[i])


def test_results_do_not_depend_on_the_thread_count_outside_the_forward(model: CausalLM) -> None:
    ids = _random_ids(40, 8)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sequence_logprobs(model, ids, start=1, deterministic=True).detach()
        torch.set_num_threads(2)
        two = sequence_logprobs(model, ids, start=1, deterministic=True).detach()
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)
    assert torch.get_num_threads() == previous


def test_deterministic_forward_is_differentiable(model: CausalLM) -> None:
    ids = _random_ids(30, 9)
    model.zero_grad()
    logprobs = sequence_logprobs(model, ids, start=10, deterministic=True)
    logprobs.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    grad_q = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad_q is not None and grad_q.abs().sum() > 0
    model.zero_grad()
    fast = sequence_logprobs(model, ids, start=10, deterministic=False)
    assert torch.allclose(fast, logprobs.detach(), atol=1e-4)
