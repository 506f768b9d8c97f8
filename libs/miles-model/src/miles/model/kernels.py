"""Row-wise numerics shared by every forward path, and the shape-invariant ("deterministic") execution of them.

Why a deterministic mode exists: on-policy RL needs the trainer's recomputed logprobs to equal the engine's
bit for bit. CPU kernels reduce in an order that depends on the *shape* of the call: a matrix product of one
row (decode) rounds differently from the same row inside a 2,000-row prefill, and elementwise transcendental
functions (exp, sigmoid) take a vector or a scalar path depending on where an element falls in the tensor and
on how threads split the work. Deterministic mode removes every such dependency:

- every row-wise computation (norms, projections, RoPE, MLP, LM head, log-softmax) runs on fixed blocks of
  `DETERMINISTIC_BLOCK_ROWS` rows, zero-padded, one kernel call per block, so each row goes through calls of
  identical shape whatever else is batched with it (a block's rows never mix: each row's result depends only
  on that row, which `tests/test_deterministic_invariance.py` checks for the kernels used here);
- attention is computed per query over exactly its own keys (`attention.exact_attention`);
- it runs single-threaded (`single_threaded()`), so no kernel splits a reduction or an elementwise loop
  across threads at a shape-dependent boundary.

Limits: the guarantee holds for one torch build on one CPU instruction set (the vector width decides the
rounding of exp); numbers differ from the fast path and from other builds in the last bits.

On CUDA the same fixed blocks make every matrix product and reduction a call of one shape, and cuBLAS and torch's
reductions give the same bits for the same shape on one GPU model with one CUDA, cuBLAS and torch build (the
thread setting above is then irrelevant). What can still differ is library state, not shapes: the engine sets
`CUBLAS_WORKSPACE_CONFIG` and `torch.use_deterministic_algorithms(True, warn_only=True)` when it computes
deterministically on a GPU (`miles.engine.device`). CUDA results differ from CPU results in the last bits, so a
CPU trainer matches a CUDA engine within a tolerance only; bit equality needs both on the same kind of GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F  # noqa: N812

DETERMINISTIC_BLOCK_ROWS = 32
"""Rows per kernel call in deterministic mode. A multiple of 32 so that a block of any width holds a whole
number of 512-bit float vectors (no scalar tail inside a block whatever the row's position)."""

_thread_lock = threading.RLock()


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch CPU kernels on one thread inside the block (process-wide setting, restored on exit)."""
    with _thread_lock:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(previous)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed like Hugging Face's (float32 variance, rsqrt, then weight)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rope_tables(head_dim: int, theta: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_positions, head_dim), computed once per model (HF's default RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (rows, heads, head_dim) by per-row cos/sin of shape (rows, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :]) + (rotated * sin[:, None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


RowFn = Callable[..., tuple[torch.Tensor, ...]]


def apply_rowwise(fn: RowFn, inputs: Sequence[torch.Tensor], *, deterministic: bool) -> tuple[torch.Tensor, ...]:
    """Apply a row-wise function (row i of every output depends only on row i of every input).

    Fast mode calls `fn` once on all rows. Deterministic mode calls it on fixed blocks of
    DETERMINISTIC_BLOCK_ROWS rows (the last block zero-padded) and concatenates, so each row is computed by
    kernel calls of the same shape whatever the number of rows. Differentiable in both modes.
    """
    if not deterministic:
        return fn(*inputs)
    num_rows = inputs[0].shape[0]
    block = DETERMINISTIC_BLOCK_ROWS
    padded_rows = max(block, -(-num_rows // block) * block)
    padded = [_pad_rows(t, padded_rows - num_rows) for t in inputs]
    pieces: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, padded_rows, block):
        pieces.append(fn(*(t[start : start + block] for t in padded)))
    return tuple(torch.cat(parts, dim=0)[:num_rows] for parts in zip(*pieces, strict=True))


def _pad_rows(t: torch.Tensor, num_pad: int) -> torch.Tensor:
    if num_pad == 0:
        return t
    return torch.cat((t, t.new_zeros((num_pad, *t.shape[1:]))), dim=0)
