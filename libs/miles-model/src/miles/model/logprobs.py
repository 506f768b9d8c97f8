"""Log-probabilities from final hidden states: the LM head and a temperature-scaled log-softmax, block by block.

A row of logits spans the whole vocabulary (~152K floats for Qwen), so rows are processed in blocks and only
what is asked for (a target's logprob, top-k) is kept. Temperature: logprobs are log_softmax(logits / T), as
SGLang reports them by default; pass T = 1 for greedy requests and for raw model logprobs.

The same functions serve the engine (sampling, reported logprobs) and the trainer (differentiable
`sequence_logprobs`), so with `deterministic=True` both compute bit-identical numbers: blocks then have exactly
DETERMINISTIC_BLOCK_ROWS rows (zero-padded) and run single-threaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from miles.model.kernels import DETERMINISTIC_BLOCK_ROWS, single_threaded
from miles.model.transformer import CausalLM

FAST_BLOCK_ROWS = 64
"""Rows per block in the fast path (bounds memory: 64 x 152K floats = 39 MB)."""


def row_blocks(num_rows: int, *, deterministic: bool) -> list[slice]:
    """The row ranges `block_logprobs` is called on, in order."""
    size = DETERMINISTIC_BLOCK_ROWS if deterministic else FAST_BLOCK_ROWS
    return [slice(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]


def block_logprobs(
    model: CausalLM, hidden: torch.Tensor, temperatures: torch.Tensor, *, deterministic: bool
) -> torch.Tensor:
    """log_softmax(hidden @ lm_head^T / temperature) for at most one block of rows: (rows, vocab)."""
    num_rows = hidden.shape[0]
    if not deterministic:
        logits = F.linear(hidden, model.lm_head_weight)
        return F.log_softmax(logits / temperatures[:, None], dim=-1)
    if num_rows > DETERMINISTIC_BLOCK_ROWS:
        raise ValueError(f"a deterministic block has at most {DETERMINISTIC_BLOCK_ROWS} rows, got {num_rows}")
    pad = DETERMINISTIC_BLOCK_ROWS - num_rows
    if pad:
        hidden = torch.cat((hidden, hidden.new_zeros((pad, hidden.shape[1]))))
        temperatures = torch.cat((temperatures, temperatures.new_ones(pad)))
    with single_threaded():
        logits = F.linear(hidden, model.lm_head_weight)
        return F.log_softmax(logits / temperatures[:, None], dim=-1)[:num_rows]


def target_logprobs(
    model: CausalLM,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor | float = 1.0,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """Logprob of targets[i] under row i of `hidden` (N, hidden) -> (N,); differentiable."""
    num_rows = hidden.shape[0]
    if isinstance(temperatures, float):
        temperatures = torch.full((num_rows,), temperatures, dtype=torch.float32, device=hidden.device)
    pieces = []
    for rows in row_blocks(num_rows, deterministic=deterministic):
        logprobs = block_logprobs(model, hidden[rows], temperatures[rows], deterministic=deterministic)
        pieces.append(logprobs.gather(1, targets[rows, None])[:, 0])
    if not pieces:
        return hidden.new_zeros(0)
    return torch.cat(pieces)


def sequence_logprobs(
    model: CausalLM,
    input_ids: torch.Tensor,
    *,
    start: int,
    temperature: float = 1.0,
    deterministic: bool = False,
    routed_experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logprobs of input_ids[start:] each given the tokens before it, from one full forward: (T - start,).

    `start` >= 1 (the first token has no logprob). Differentiable: the trainer's loss goes through it. With
    deterministic=True the values equal, bit for bit, what the engine reports for the same tokens in
    deterministic mode (as output logprobs while generating, or as input logprobs when scoring).

    `routed_experts` (MoE models, routing replay): expert ids of the tokens fed through the model, either
    (T - 1, num_moe_layers, top_k) as SGLang reports them (the last token is never fed: no logprob depends on
    it, so it is left out of the forward) or (T, num_moe_layers, top_k).
    """
    num_tokens = input_ids.shape[0]
    if not 1 <= start <= num_tokens:
        raise ValueError(f"start must be in [1, {num_tokens}], got {start}")
    if routed_experts is None or routed_experts.shape[0] != num_tokens - 1:
        hidden = model(input_ids, deterministic=deterministic, routed_experts=routed_experts)[:-1]
    elif num_tokens == 1:
        hidden = model.model.embed_tokens.weight.new_zeros((0, model.config.hidden_size))
    else:
        hidden = model(input_ids[:-1], deterministic=deterministic, routed_experts=routed_experts)
    return target_logprobs(model, hidden[start - 1 :], input_ids[start:], temperature, deterministic=deterministic)
