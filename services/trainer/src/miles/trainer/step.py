"""One trainer step over a planned batch: ppo_epochs passes over its minibatches, one optimizer step per
minibatch and epoch, then one scheduler step. Runs on every rank with that rank's micro-batches.

    signal = minibatches with a loss-masked token whose advantage != 0 (or any loss token with a KL/entropy
             term, or SFT)
    updates = ppo_epochs * |signal|;  none: the step is skipped (no forward, nothing touched)
    pi_old: updates == 1: the forward's own output, detached (no extra pass)
            updates > 1:  a no-grad scoring pass over the signal minibatches before the first update, fixed for
                          every epoch (so are the TIS/MIS weights computed from it)
    critic (`gae`): that scoring pass runs whatever the number of updates and also gives V_old, the value head's
            predictions before the first update; GAE advantages and value targets are computed from them on each
            rank for its own micro-batches (critic.py), whitened over the whole batch, fixed for every epoch
    for epoch, for minibatch in signal: zero_grad, forward/backward per micro-batch, optimizer step
    scheduler step (once per trainer step: the LR schedule runs over train.num_steps trainer steps)

A minibatch without signal would give a zero gradient on which AdamW still moves the weights (momentum, weight
decay) and advances its step count: it is not run at all. The decision is a function of the plan, which every
rank holds whole, so all ranks skip the same minibatches and their FSDP collectives stay in lockstep; a rank
with fewer micro-batches than another runs empty ones.

Forward/backward goes through `backend.run_micro_batches` with a `consume` callback that turns a micro-batch's
outputs into its loss, so that a pipeline-parallel backend can run its own schedule and compute the loss on its
last stage only. KL reference logprobs are therefore computed before a minibatch's forward/backward
(`backend.reference_batches`, a collective pass like the others), once, and kept for the later epochs. `rank` and
`world_size` are data-parallel ones (`TrainBackend.data_ranks`): tensor- and pipeline-parallel peers train the
same micro-batches; ranks whose statistics would duplicate another's (or never see the loss) contribute none.

Statistics: each optimizer step's statistics are merged over ranks, then every statistic of the trainer step is
the mean over its optimizer steps (of those that counted it), minima and maxima over all of them. The strict
on-policy check runs before the first update (on the scoring pass, or on the only update's forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from miles.common.jobspec.trainer import TrainConfig
from miles.trainer.backends.base import TokenOutputs, TrainBackend
from miles.trainer.batch import TrainSample
from miles.trainer.critic import CriticTargets, critic_targets
from miles.trainer.microbatch import MicroBatchContext, add_mismatch_stats, flatten, micro_batch_loss
from miles.trainer.stats import StepStats, mean_over_updates

DUMMY_SAMPLE = TrainSample(
    group_id="",
    sample_id="dummy",
    group_index=0,
    tokens=[0, 0],
    response_start=1,
    loss_mask=[0],
    rollout_logprobs=[0.0],
    reward=0.0,
    trainable=False,
    min_version=None,
    max_version=None,
)
MicroKey = tuple[int, int]


@dataclass
class MiniBatch:
    """The data of one optimizer step. `micro_batches[rank][i]` are the samples of micro-batch i of a rank;
    ranks with fewer micro-batches than `num_micro_batches` run empty ones (FSDP collectives stay in lockstep).
    Global counts are over the whole minibatch (the loss of its optimizer step is divided by them)."""

    micro_batches: list[list[list[TrainSample]]]
    global_num_tokens: int
    global_num_seqs: int

    @property
    def num_micro_batches(self) -> int:
        return max((len(per_rank) for per_rank in self.micro_batches), default=0)

    def samples(self) -> list[TrainSample]:
        return [s for per_rank in self.micro_batches for micro in per_rank for s in micro]


@dataclass
class StepPlan:
    """What every rank needs to run one trainer step: the batch split into minibatches (in order)."""

    minibatches: list[MiniBatch]
    trainer_version: int

    @property
    def num_micro_batches(self) -> int:
        """Forward/backward passes per epoch (over every minibatch)."""
        return sum(minibatch.num_micro_batches for minibatch in self.minibatches)


@dataclass
class StepResult:
    """Merged statistics of every rank; `violation` is set (and no optimizer step taken) when strict on-policy
    failed; `num_optimizer_steps` 0 means the trainer step was skipped (no signal)."""

    stats: dict[str, float]
    num_optimizer_steps: int = 0
    grad_norm: float = 0.0
    learning_rate: float = 0.0
    violation: str | None = None
    forward_backward_s: float = 0.0
    optimizer_s: float = 0.0


def has_signal(samples: Sequence[TrainSample], config: TrainConfig) -> bool:
    """Whether an optimizer step on these samples can have a non-zero gradient: a loss-masked token with a
    non-zero advantage (the sample's, or its own per-token one: on-policy distillation's, whatever the task reward's
    group advantage), or any loss-masked token when a KL/entropy term, the SFT loss or a critic (GAE advantages,
    value loss) applies."""
    tokens = [s for s in samples if s.num_loss_tokens > 0]
    loss = config.loss
    if loss.kind == "sft" or loss.kl_coef > 0 or loss.entropy_coef > 0 or config.critic is not None:
        return bool(tokens)
    return any(_has_nonzero_advantage(s) for s in tokens)


def _has_nonzero_advantage(sample: TrainSample) -> bool:
    if sample.token_advantages is None:
        return sample.advantage != 0.0
    return any(a != 0.0 and m for a, m in zip(sample.token_advantages, sample.loss_mask, strict=True))


def run_step(
    backend: TrainBackend,
    plan: StepPlan,
    config: TrainConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    merge_stats: Callable[[StepStats], StepStats] | None = None,
    reports_stats: bool = True,
) -> StepResult:
    """The trainer step of the module docstring on this rank (data rank `rank` of `world_size`); statistics merged
    over ranks by `merge_stats`, this rank's left out unless `reports_stats`."""

    def merge(stats: StepStats) -> StepStats:
        own = stats if reports_stats else StepStats()
        return merge_stats(own) if merge_stats is not None else own

    signal = [index for index, mb in enumerate(plan.minibatches) if has_signal(mb.samples(), config)]
    num_updates = config.ppo_epochs * len(signal)
    counts = {
        "num_optimizer_steps": float(num_updates),
        "num_optimizer_steps_skipped": float(config.ppo_epochs * (len(plan.minibatches) - len(signal))),
    }
    if num_updates == 0:
        return StepResult(stats=counts)
    started = time.perf_counter()
    scored_before = num_updates > 1 or config.critic is not None
    scored = _Scored()
    if scored_before:
        scored = _score_before_updates(backend, plan, signal, config, rank, merge)
        if scored.violation is not None:
            elapsed_s = time.perf_counter() - started
            return StepResult(stats=scored.stats | counts, violation=scored.violation, forward_backward_s=elapsed_s)
        counts |= scored.critic_stats
    proximal = scored.proximal if num_updates > 1 else {}  # one update: pi_old is its own forward (ratio 1)
    runner = _Updates(backend, plan, config, rank, world_size, proximal, scored.critic)
    learning_rate = backend.learning_rate()
    updates: list[StepStats] = []
    grad_norms: list[float] = []
    for _ in range(config.ppo_epochs):
        for index in signal:
            merged = merge(runner.forward_backward(index))
            if not scored_before:  # pi_old is this forward's output: check before the only optimizer step
                violation = _on_policy_violation(merged.result(), config)
                if violation is not None:
                    backend.zero_grad()
                    return StepResult(
                        stats=merged.result() | counts, violation=violation, forward_backward_s=runner.elapsed_s
                    )
            grad_norms.append(runner.optimizer_step())
            updates.append(merged)
    backend.advance_schedule()
    return StepResult(
        stats=mean_over_updates(updates) | counts | {"grad_norm_max": max(grad_norms)},
        num_optimizer_steps=num_updates,
        grad_norm=sum(grad_norms) / len(grad_norms),
        learning_rate=learning_rate,
        forward_backward_s=time.perf_counter() - started - runner.optimizer_s,
        optimizer_s=runner.optimizer_s,
    )


def _own(minibatch: MiniBatch, rank: int) -> list[list[TrainSample]]:
    return minibatch.micro_batches[rank] if rank < len(minibatch.micro_batches) else []


def _padded(minibatch: MiniBatch, rank: int) -> list[list[TrainSample]]:
    """This rank's micro-batches, then empty ones (one dummy sample, nothing trained) up to the minibatch's
    most, so that every rank runs the same number of forward/backward passes."""
    own = _own(minibatch, rank)
    return own + [[DUMMY_SAMPLE]] * (minibatch.num_micro_batches - len(own))


@dataclass
class _Scored:
    """What the scoring pass before the first update gives: pi_old, the critic's targets and statistics (empty
    without a critic), the merged scoring statistics and the strict on-policy verdict."""

    proximal: dict[MicroKey, torch.Tensor] = field(default_factory=dict)
    critic: dict[MicroKey, CriticTargets] = field(default_factory=dict)
    critic_stats: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    violation: str | None = None


def _score_before_updates(
    backend: TrainBackend,
    plan: StepPlan,
    signal: Sequence[int],
    config: TrainConfig,
    rank: int,
    merge: Callable[[StepStats], StepStats],
) -> _Scored:
    """The no-grad pass over the signal minibatches before the first update (several updates, or a critic), the
    strict on-policy check on it, and then (critic) the GAE targets of this rank's micro-batches."""
    proximal, values, stats = _score_proximal(backend, plan, signal, config, rank)
    merged = merge(stats).result()
    scored = _Scored(proximal=proximal, stats=merged, violation=_on_policy_violation(merged, config))
    if scored.violation is None and config.critic is not None:
        own = {(i, m): micro for i in signal for m, micro in enumerate(_own(plan.minibatches[i], rank))}
        eps = config.loss.advantage_eps
        scored.critic, scored.critic_stats = critic_targets(own, values, config.critic, eps=eps, merge=merge)
    return scored


@torch.no_grad()
def _score_proximal(
    backend: TrainBackend, plan: StepPlan, signal: Sequence[int], config: TrainConfig, rank: int
) -> tuple[dict[MicroKey, torch.Tensor], dict[MicroKey, torch.Tensor], StepStats]:
    """pi_old of every loss token of the signal minibatches, under the weights before the first update, and the
    value head's predictions there (V_old; empty without a value head)."""
    proximal: dict[MicroKey, torch.Tensor] = {}
    values: dict[MicroKey, torch.Tensor] = {}
    stats = StepStats()
    for index in signal:
        minibatch = plan.minibatches[index]
        own = _own(minibatch, rank)

        def consume(micro: int, outputs: TokenOutputs, index: int = index, own: list[list[TrainSample]] = own) -> None:
            if micro < len(own):
                proximal[(index, micro)] = outputs.logprobs.detach()
                if outputs.values is not None:
                    values[(index, micro)] = outputs.values.detach()
                add_mismatch_stats(proximal[(index, micro)], flatten(own[micro], plan.trainer_version), stats)

        backend.run_micro_batches(
            _padded(minibatch, rank), consume, temperature=config.loss.temperature, entropy_grad=False, backward=False
        )
    return proximal, values, stats


class _Updates:
    """Forward/backward and optimizer step of one minibatch at a time; reference logprobs computed in the first
    epoch are kept for the next ones (they do not depend on the trained weights)."""

    def __init__(
        self,
        backend: TrainBackend,
        plan: StepPlan,
        config: TrainConfig,
        rank: int,
        world_size: int,
        proximal: dict[MicroKey, torch.Tensor],
        critic: dict[MicroKey, CriticTargets],
    ) -> None:
        self.backend, self.plan, self.config = backend, plan, config
        self.rank, self.world_size = rank, world_size
        self.proximal = proximal
        self.critic = critic
        self.reference: dict[MicroKey, torch.Tensor] = {}
        self.referenced: set[int] = set()
        self.started = time.perf_counter()
        self.optimizer_s = 0.0

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started - self.optimizer_s

    def forward_backward(self, index: int) -> StepStats:
        """Gradients of minibatch `index` accumulated over this rank's micro-batches; its statistics."""
        self.backend.zero_grad()
        minibatch = self.plan.minibatches[index]
        own = _own(minibatch, self.rank)
        padded = _padded(minibatch, self.rank)
        loss_config = self.config.loss
        if loss_config.kind != "sft" and loss_config.kl_coef > 0 and index not in self.referenced:
            self.referenced.add(index)  # every rank decides alike, so the collective pass runs once everywhere
            references = self.backend.reference_batches(padded, temperature=loss_config.temperature)
            for micro, reference in enumerate(references[: len(own)]):
                if reference is not None:
                    self.reference[(index, micro)] = reference
        stats = StepStats()

        def consume(micro: int, outputs: TokenOutputs) -> torch.Tensor:
            if micro >= len(own):  # every trained parameter gets a (zero) gradient: FSDP's collectives stay matched
                loss = outputs.logprobs.sum() * 0.0
                if outputs.values is not None:
                    loss = loss + outputs.values.sum() * 0.0
            else:
                context = MicroBatchContext(
                    global_num_tokens=minibatch.global_num_tokens,
                    global_num_seqs=minibatch.global_num_seqs,
                    trainer_version=self.plan.trainer_version,
                    proximal_logprobs=self.proximal.get((index, micro)),
                    reference_logprobs=self.reference.get((index, micro)),
                    critic=self.critic.get((index, micro)),
                )
                loss = micro_batch_loss(outputs, own[micro], context, self.config, stats)
            # Gradients are averaged over data ranks; the loss is already a share of the minibatch's global sum.
            return loss * self.world_size

        self.backend.run_micro_batches(
            padded,
            consume,
            temperature=loss_config.temperature,
            entropy_grad=loss_config.entropy_coef > 0,
            backward=True,
        )
        return stats

    def optimizer_step(self) -> float:
        started = time.perf_counter()
        grad_norm = self.backend.step(self.config.optimizer.grad_clip_norm)
        self.optimizer_s += time.perf_counter() - started
        return grad_norm


def _on_policy_violation(values: dict[str, float], config: TrainConfig) -> str | None:
    if not config.strict_on_policy:
        return None
    worst = values.get("current_version_logprob_abs_diff_max", 0.0)
    if worst != 0.0:
        return (
            f"strict_on_policy: recomputed logprobs of current-version data differ from the rollout logprobs "
            f"(max abs diff {worst:.3g}); engine and trainer must run deterministic mode with the same weights"
        )
    return None
