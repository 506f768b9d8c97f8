"""Rollout Routing Replay (R3) in the torch backend: the expert ids a packed forward replays, and the routing
agreement statistic.

A micro-batch is fed as `packed_rows(samples, trim_routed=True)` lays it out: a sample carrying routing feeds its
positions 0..T-2, exactly the rows its recorded routing covers (its last token is never fed, as the engine never
fed it: no logprob depends on it); any other sample feeds all its tokens.

Replay (the job replays and a sample of the micro-batch carries routing): miles.model replays every row of a
forward or none, so every fed row needs expert ids. A sample carrying routing gets exactly its recorded ids. The
others get a fixed filler (experts 0..top_k-1 at every layer): with replay on, batch.py lets only samples that
are not trained on (ABORTED, FAILED, a one-token sample) lack routing, their outputs are masked out of every loss
and statistic, and attention is per sequence, so the filler reaches no other sample.

Agreement: per MoE layer, the fraction of the micro-batch's routed positions whose router top-k *set* (what
`CausalLM.forward_routed` reports as the router's own pick; under replay, given the replayed experts of the
layers before) equals the recorded set. 1.0 everywhere while trainer and engine route alike; it drops as the
trainer's weights move away from the ones that generated the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles.common.contracts.routing import RoutingShape
from miles.model import ModelConfig
from miles.trainer.backends.common import is_routed
from miles.trainer.batch import TrainSample


def model_routing_shape(config: ModelConfig) -> RoutingShape | None:
    """The routing shape of a miles.model config (None for a dense model)."""
    if config.num_moe_layers == 0:
        return None
    return RoutingShape(
        num_layers=config.num_moe_layers, top_k=config.num_experts_per_tok, num_experts=config.num_experts
    )


@dataclass(frozen=True)
class RecordedRouting:
    """The recorded routing of a packed micro-batch: `rows` (int64, the fed rows it covers, ascending) and
    `expert_ids` (len(rows), num_layers, top_k) int64, row for row."""

    rows: torch.Tensor
    expert_ids: torch.Tensor


def sample_routing(sample: TrainSample, shape: RoutingShape) -> torch.Tensor:
    """A routed sample's recorded ids as (num_tokens - 1, num_layers, top_k) int64."""
    assert sample.routed_experts is not None
    num_rows = sample.num_tokens - 1
    if len(sample.routed_experts) != num_rows * shape.row_width:
        raise ValueError(
            f"sample {sample.sample_id!r}: {len(sample.routed_experts)} routed expert ids, need {num_rows} rows of "
            f"{shape.num_layers} x {shape.top_k}"
        )
    ids = torch.frombuffer(sample.routed_experts, dtype=torch.int32)
    return ids.view(num_rows, shape.num_layers, shape.top_k).to(torch.int64)


def recorded_routing(
    samples: Sequence[TrainSample], token_ids: Sequence[torch.Tensor], shape: RoutingShape
) -> RecordedRouting | None:
    """Where the routing of `samples` sits in their packed forward (`token_ids`: what each feeds); None when no
    sample carries routing."""
    rows: list[torch.Tensor] = []
    expert_ids: list[torch.Tensor] = []
    offset = 0
    for sample, fed in zip(samples, token_ids, strict=True):
        if is_routed(sample):
            rows.append(torch.arange(offset, offset + fed.shape[0]))
            expert_ids.append(sample_routing(sample, shape))
        offset += fed.shape[0]
    if not rows:
        return None
    return RecordedRouting(rows=torch.cat(rows), expert_ids=torch.cat(expert_ids))


def replay_ids(recorded: RecordedRouting, num_rows: int, shape: RoutingShape) -> torch.Tensor:
    """(num_rows, num_layers, top_k) int64 ids for every fed row: the recorded ones, the filler elsewhere."""
    filler = torch.arange(shape.top_k, dtype=torch.int64).expand(num_rows, shape.num_layers, shape.top_k)
    ids = filler.clone()
    ids[recorded.rows] = recorded.expert_ids
    return ids


def routing_agreement(picks: torch.Tensor, recorded: RecordedRouting) -> torch.Tensor:
    """Per MoE layer, the fraction of recorded rows whose top-k set in `picks` (the forward's router choices,
    (rows, num_layers, top_k)) equals the recorded set: float32 (num_layers,)."""
    own = picks.to(device="cpu", dtype=torch.int64)[recorded.rows].sort(dim=-1).values
    wanted = recorded.expert_ids.sort(dim=-1).values
    return (own == wanted).all(dim=-1).to(torch.float32).mean(dim=0)
