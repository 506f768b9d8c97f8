"""The interface every training backend implements, and the one function that picks a backend.

A backend owns the model (and a frozen reference copy when a KL term needs one), the optimizer and the
scheduler, and the mapping to Hugging Face tensor names. It knows nothing of losses, buffers or checkpoints
on disk: `step.py` asks it for logprobs of packed sequences, back-propagates, and asks it to step;
`checkpoint.py` asks it for state dicts. Under torch.distributed every method except `forward` /
`reference_logprobs` on a rank's own micro-batch is collective: every rank calls it, in the same order.

`step.py` drives forward/backward through `run_micro_batches`, handing the backend a `consume` function that turns
a micro-batch's `TokenOutputs` into its loss: the default runs forward, consume, backward per micro-batch; a
pipeline-parallel backend runs its schedule instead and calls `consume` only where the logits are (the last
stage). `data_ranks` says which share of each minibatch a process trains (its data-parallel rank) and whether its
statistics count (one rank per data-parallel replica).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.common.contracts.routing import RoutingShape
from miles.common.errors import ConfigError
from miles.common.jobspec.trainer import OptimizerConfig, TrainConfig
from miles.trainer.batch import TrainSample

if TYPE_CHECKING:
    import torch

    from miles.trainer.settings import TrainerSettings


@dataclass(frozen=True)
class TokenOutputs:
    """Per response token of the micro-batch's samples, concatenated in sample order (every response token,
    loss-masked or not): `logprobs` (differentiable in train mode) and the entropy of each token's distribution
    (differentiable only when asked for)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    routing_agreement: torch.Tensor | None = None
    """MoE with recorded routing only: per MoE layer, the fraction of the micro-batch's token positions whose own
    router top-k set equals the recorded one (1.0 everywhere when nothing flipped), float32 [num_layers]."""
    values: torch.Tensor | None = None
    """PPO with a critic (torch backend): the value head's V(prefix) of every response token, float32, differentiable
    in train mode; None without a value head."""


@dataclass(frozen=True)
class ModelShape:
    """What the trainer needs to know of the model to validate data."""

    vocab_size: int
    max_positions: int
    routing: RoutingShape | None = None
    """The model's MoE routing shape (None for a dense model): what recorded routing must match."""


@dataclass(frozen=True)
class DataRanks:
    """A process's share of each minibatch: micro-batches of data-parallel rank `rank` of `size` (the plan is laid
    out over `size` data ranks); `reports_stats` is false on ranks whose statistics duplicate another's (tensor-
    parallel peers) or that never see the loss (earlier pipeline stages)."""

    rank: int
    size: int
    reports_stats: bool = True


Consume = Callable[[int, TokenOutputs], "torch.Tensor | None"]
"""consume(index, outputs) -> the loss of micro-batch `index` (None: nothing to back-propagate)."""


class TrainBackend(abc.ABC):
    """Model + optimizer of one trainer process."""

    name: str = "base"
    shape: ModelShape

    @abc.abstractmethod
    def forward(self, samples: Sequence[TrainSample], *, temperature: float, entropy_grad: bool) -> TokenOutputs:
        """Logprobs (and entropies) of every response token of `samples`, packed into one forward."""

    @abc.abstractmethod
    def reference_logprobs(self, samples: Sequence[TrainSample], *, temperature: float) -> torch.Tensor:
        """Logprobs of the same tokens under the frozen reference weights (no gradient)."""

    def data_ranks(self, rank: int, world_size: int) -> DataRanks:
        """Every process is its own data rank (torch backend: FSDP shards parameters, not the batch's work)."""
        return DataRanks(rank=rank, size=world_size)

    def run_micro_batches(
        self,
        micro_batches: Sequence[Sequence[TrainSample]],
        consume: Consume,
        *,
        temperature: float,
        entropy_grad: bool,
        backward: bool,
    ) -> None:
        """Forward every micro-batch in order, hand its outputs to `consume` and (when `backward`) back-propagate
        the loss it returns. Collective: every rank passes the same number of micro-batches."""
        import torch

        for index, samples in enumerate(micro_batches):
            outputs = self.forward(samples, temperature=temperature, entropy_grad=entropy_grad)
            loss = consume(index, outputs)
            if backward and loss is not None:
                torch.autograd.backward(loss)

    def reference_batches(
        self, micro_batches: Sequence[Sequence[TrainSample]], *, temperature: float
    ) -> list[torch.Tensor | None]:
        """`reference_logprobs` of every micro-batch (None where this rank does not compute the loss).
        Collective, like run_micro_batches."""
        return [self.reference_logprobs(samples, temperature=temperature) for samples in micro_batches]

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def step(self, grad_clip_norm: float | None) -> float:
        """Clip gradients and take one optimizer step (not a scheduler step); returns the pre-clip global grad
        norm."""

    @abc.abstractmethod
    def advance_schedule(self) -> None:
        """One scheduler step: once per trainer step, however many optimizer steps it took."""

    @abc.abstractmethod
    def learning_rate(self) -> float: ...

    @abc.abstractmethod
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights under Hugging Face names, float32 on the CPU (collective; meaningful on rank 0)."""

    @abc.abstractmethod
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the trained weights by these (collective; the tensors are read on rank 0)."""

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The weights a `full` checkpoint stores (collective; meaningful on rank 0): hf_state_dict, or only the
        trained adapter under PEFT names when the base is frozen (LoRA)."""
        return self.hf_state_dict()

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what checkpoint_tensors returned (collective; the tensors are read on rank 0)."""
        self.load_hf_state_dict(tensors)

    @abc.abstractmethod
    def optimizer_state(self) -> dict[str, Any]:
        """Optimizer and scheduler state (collective; meaningful on rank 0)."""

    @abc.abstractmethod
    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore what optimizer_state returned (collective; read on rank 0)."""

    def sharded_state(self) -> dict[str, Any] | None:
        """`{"model", "optimizer", "scheduler"}` state dicts whose tensors are this rank's own shards (DTensors under
        FSDP, keyed by parameter name), for torch.distributed.checkpoint to write and to load in place at any world
        size; None when the backend cannot give them (the sharded checkpoint format is then refused)."""
        return None

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """Apply a `sharded_state()` dict that torch.distributed.checkpoint has loaded into (collective)."""
        raise NotImplementedError(f"the {self.name} backend has no sharded state")


def lr_multiplier(step: int, config: OptimizerConfig, num_steps: int) -> float:
    """Learning-rate factor after `step` scheduler steps (trainer steps): linear warm-up, then
    constant/linear/cosine decay."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant" or num_steps <= config.warmup_steps:
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / max(1, num_steps - config.warmup_steps))
    floor = config.min_lr_ratio
    if config.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def resolve_routing_replay(train: TrainConfig, routing: RoutingShape | None) -> bool:
    """Whether the job replays recorded MoE routing (R3): `train.routing_replay`, or when it is None, whether the
    model is MoE. Raises ConfigError for `true` with a dense model (there is nothing to replay, and the samples
    would be refused for lacking routing the engine cannot record)."""
    if train.routing_replay is None:
        return routing is not None
    if train.routing_replay and routing is None:
        raise ConfigError(
            "train.routing_replay is true but the model has no MoE layers: routing replay (R3) needs a "
            "mixture-of-experts model (leave it unset or false for a dense model)",
            field="train.routing_replay",
        )
    return train.routing_replay


def make_backend(settings: TrainerSettings, train: TrainConfig | None = None) -> TrainBackend:
    """The backend named by settings.backend, with its model loaded from settings.model_path. Raises ConfigError
    when the recipe cannot work with that backend or model (LoRA or a critic on megatron, routing replay on a dense
    model)."""
    train = train or settings.train
    backend: TrainBackend
    if settings.backend == "torch":
        from miles.trainer.backends.torch_backend import TorchBackend

        backend = TorchBackend.from_settings(settings, train)
    elif settings.backend == "megatron":
        if train.lora is not None:
            raise ConfigError("train.lora: LoRA is implemented by the torch backend only", field="train.lora")
        if train.critic is not None:
            why = "train.critic: PPO with a critic (a value head) is implemented by the torch backend only"
            raise ConfigError(why, field="train.critic")
        from miles.trainer.backends.megatron_backend import MegatronBackend

        backend = MegatronBackend.from_settings(settings, train)
    else:
        raise ValueError(f"unknown backend {settings.backend!r}")
    resolve_routing_replay(train, backend.shape.routing)
    return backend
