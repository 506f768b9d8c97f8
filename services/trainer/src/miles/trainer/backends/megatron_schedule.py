"""The multi-rank Megatron step: micro-batches through megatron-core's pipeline schedule, then gradients made
whole across ranks, clipped by their global norm.

Pipeline (PP > 1): `get_forward_backward_func()` (the non-interleaved 1F1B schedule) runs the micro-batches; each
stage's `forward_step` feeds its micro-batch (ids and mask on every stage, the hidden states arrive by
point-to-point from the previous stage), and the loss function runs on the last stage only, where the logits
are: that is where `TokenOutputs` exist and the trainer's loss is computed (`consume`). Micro-batches differ in
shape, so `variable_seq_lengths` sends each activation's shape first. The loss function returns a token count
of 1 and `calculate_per_token_loss` is on, so megatron does not rescale the trainer's loss.

Gradients (`finalize_grads`, our own rather than megatron's DistributedDataParallel, whose grad buffers and
`main_grad` would bypass torch.optim): after all micro-batches of an optimizer step,
- q/k-norm gradients are summed over TP (each TP rank saw only its heads; megatron's finalize does the same);
- with tied embeddings and PP > 1, the embedding's and the last stage's output-layer copy's gradients are summed
  over megatron's embedding group, so both copies take the same update;
- dense gradients are averaged over the data-parallel group and expert gradients summed over the
  expert-data-parallel group then divided by the data-parallel size (an expert's gradient on its EP rank
  already holds the tokens every EP rank dispatched to it), matching the loss scale step.py uses
  (each data rank's loss x data-parallel size).
A parameter without a gradient gets zeros first, so every rank reduces the same tensors.

The global norm (`clip_grad_norm`) sums squares once per distinct element: TP-sharded tensors on every TP rank,
replicated ones on TP rank 0, the tied copy never; over the model-parallel group (TP x PP) for dense tensors and
the expert model-parallel group (ETP x EP x PP) for experts. Clipping multiplies by min(1, max / (norm + 1e-6))
as torch's clip_grad_norm_ does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles.trainer.backends.base import Consume, TokenOutputs
from miles.trainer.backends.megatron_parallel import RankLayout, comm_device
from miles.trainer.backends.megatron_shards import EMBEDDING, OUTPUT_LAYER, ShardSpec
from miles.trainer.batch import TrainSample

Params = Sequence[tuple[ShardSpec, torch.nn.Parameter]]
StageForward = Callable[[Any, Sequence[TrainSample]], torch.Tensor]
"""stage_forward(model, samples): a stage's output (the last stage's: the real vocabulary's logits)."""
OutputsOf = Callable[[torch.Tensor, Sequence[TrainSample], bool], tuple[torch.Tensor, torch.Tensor]]
"""outputs_of(logits, samples, entropy_grad): per response token logprobs and entropies."""


def pipeline_forward_backward(
    model: Any,
    num_micro_batches: int,
    forward: Callable[[Any, int], torch.Tensor],
    consume: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    forward_only: bool,
) -> None:
    """Run `num_micro_batches` through the pipeline: `forward(model, index)` on every stage, `consume(index,
    logits)` on the last (a scalar loss; backpropagated unless `forward_only`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func  # type: ignore[import-untyped]

    one_token = torch.tensor(1, dtype=torch.int)

    def forward_step(data_iterator: Any, stage_model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
        index = next(data_iterator)

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            return consume(index, logits), one_token, {}

        return forward(stage_model, index), loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(range(num_micro_batches)),
        model=[model],
        num_microbatches=num_micro_batches,
        seq_length=1,  # shapes travel with each activation (variable_seq_lengths)
        micro_batch_size=1,
        forward_only=forward_only,
    )


def pipeline_micro_batches(
    model: Any,
    micro_batches: Sequence[Sequence[TrainSample]],
    stage_forward: StageForward,
    outputs_of: OutputsOf,
    consume: Consume,
    *,
    entropy_grad: bool,
    backward: bool,
) -> None:
    """`TrainBackend.run_micro_batches` through the schedule: `consume` on the last stage."""

    def on_logits(index: int, logits: torch.Tensor) -> torch.Tensor:
        logprobs, entropy = outputs_of(logits, micro_batches[index], entropy_grad)
        loss = consume(index, TokenOutputs(logprobs=logprobs, entropy=entropy))
        return loss if loss is not None else logprobs.sum() * 0.0

    pipeline_forward_backward(
        model,
        len(micro_batches),
        lambda stage, index: stage_forward(stage, micro_batches[index]),
        on_logits,
        forward_only=not backward,
    )


@torch.no_grad()
def pipeline_references(
    model: Any, micro_batches: Sequence[Sequence[TrainSample]], stage_forward: StageForward, outputs_of: OutputsOf
) -> list[torch.Tensor | None]:
    """Logprobs of every micro-batch through a forward-only pass: on the last stage (None elsewhere)."""
    results: list[torch.Tensor | None] = [None] * len(micro_batches)

    def on_logits(index: int, logits: torch.Tensor) -> torch.Tensor:
        results[index] = outputs_of(logits, micro_batches[index], False)[0]
        return logits.sum() * 0.0

    pipeline_forward_backward(
        model,
        len(micro_batches),
        lambda stage, index: stage_forward(stage, micro_batches[index]),
        on_logits,
        forward_only=True,
    )
    return results


@torch.no_grad()
def pipeline_forward(
    model: Any, samples: Sequence[TrainSample], stage_forward: StageForward, outputs_of: OutputsOf
) -> TokenOutputs:
    """One micro-batch forward-only through the pipeline; its token outputs broadcast from the last stage to
    every stage of the pipeline (detached)."""
    from megatron.core import parallel_state  # type: ignore[import-untyped]

    outputs = torch.zeros(2, sum(len(sample.loss_mask) for sample in samples), device=comm_device())

    def on_logits(index: int, logits: torch.Tensor) -> torch.Tensor:
        outputs.copy_(torch.stack(outputs_of(logits, samples, False)))
        return logits.sum() * 0.0

    pipeline_forward_backward(model, 1, lambda stage, _: stage_forward(stage, samples), on_logits, forward_only=True)
    dist.broadcast(
        outputs,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return TokenOutputs(logprobs=outputs[0].cpu().clone(), entropy=outputs[1].cpu().clone())


def _all_reduce(tensors: list[torch.Tensor], group: Any, scale: float = 1.0) -> None:
    """Sum `tensors` over `group` in one flat buffer, then multiply by `scale`."""
    if not tensors or dist.get_world_size(group) == 1:
        if scale != 1.0:
            for tensor in tensors:
                tensor.mul_(scale)
        return
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    for tensor, synced in zip(tensors, torch.split(flat, [tensor.numel() for tensor in tensors]), strict=True):
        tensor.copy_(synced.view_as(tensor))


@torch.no_grad()
def finalize_grads(params: Params, layout: RankLayout, *, qk_norm: bool, tied: bool) -> None:
    """Make every rank's gradients those of the whole batch on the whole model (module docstring)."""
    from megatron.core import parallel_state  # type: ignore[import-untyped]

    for _, param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    if qk_norm and layout.sizes.tp > 1:
        norms = [p.grad for s, p in params if "q_layernorm" in s.global_name or "k_layernorm" in s.global_name]
        _all_reduce([g for g in norms if g is not None], parallel_state.get_tensor_model_parallel_group())
    if tied and layout.sizes.pp > 1 and parallel_state.is_rank_in_embedding_group():
        # The first stage holds the embedding, the last its output-layer copy: one tensor each.
        copies = [
            p.grad for s, p in params if s.source_name == EMBEDDING and s.global_name in (EMBEDDING, OUTPUT_LAYER)
        ]
        _all_reduce([g for g in copies if g is not None], parallel_state.get_embedding_group())
    scale = 1.0 / layout.dp_size
    dense = [p.grad for s, p in params if not s.expert and p.grad is not None]
    experts = [p.grad for s, p in params if s.expert and p.grad is not None]
    _all_reduce(dense, parallel_state.get_data_parallel_group(), scale)
    _all_reduce(experts, parallel_state.get_expert_data_parallel_group(), scale)


@torch.no_grad()
def clip_grad_norm(params: Params, max_norm: float | None) -> float:
    """The global gradient norm (each distinct element once); gradients scaled down to `max_norm` when set."""
    from megatron.core import parallel_state  # type: ignore[import-untyped]

    squares = torch.zeros(2, dtype=torch.float64, device=comm_device())  # [dense, expert]
    for spec, param in params:
        if param.grad is None or not spec.counted:
            continue
        squares[int(spec.expert)] += param.grad.double().pow(2).sum().to(squares.device)
    dense, expert = squares[:1].clone(), squares[1:].clone()
    dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
    dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    norm = float((dense + expert).sqrt())
    if max_norm is not None:
        coefficient = min(1.0, max_norm / (norm + 1e-6))
        for _, param in params:
            if param.grad is not None:
                param.grad.mul_(coefficient)
    return norm
