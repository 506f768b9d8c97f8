"""Where a Megatron rank sits in the parallel grid, and the checks that the grid fits the model.

world_size = TP x PP x DP; expert parallelism (EP) is carved out of DP (megatron-core's expert grid is
ETP x EP x expert-DP x PP with ETP = TP), so DP must be a multiple of EP. Ranks are laid out by megatron-core's
default order `tp-cp-ep-dp-pp`: the ranks of a TP group are consecutive, pipeline stages are furthest apart.
`parallel_state.initialize_model_parallel` builds the groups over the trainer's process group (gloo on the CPU,
nccl on CUDA); the trainer's own rank model (rank 0 broadcasts each operation) is unchanged: every rank runs every
operation, and a rank's data-parallel index says which share of each minibatch it trains.

Not driven here: sequence parallelism, context parallelism, virtual (interleaved) pipeline stages, and pipeline
or tensor parallelism on MoE models (EP is their parallel axis; see `check_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.common.errors import ConfigError

if TYPE_CHECKING:  # settings.py imports this module without torch
    from miles.model import ModelConfig


@dataclass(frozen=True)
class ParallelSizes:
    """Tensor-, pipeline- and expert-parallel sizes (the trainer's `megatron.tp_size`, `pp_size`, `ep_size`)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)


def check_world(sizes: ParallelSizes, world_size: int) -> list[str]:
    """What is wrong with these sizes for `world_size` processes, whatever the model (empty when nothing)."""
    problems = []
    if world_size % (sizes.tp * sizes.pp):
        problems.append(
            f"world_size {world_size} is not divisible by tp_size x pp_size = {sizes.tp} x {sizes.pp} "
            "(data-parallel size = world_size / (tp_size x pp_size))"
        )
    elif sizes.data_parallel_size(world_size) % sizes.ep:
        problems.append(
            f"ep_size {sizes.ep} must divide the data-parallel size {sizes.data_parallel_size(world_size)} "
            f"(world_size {world_size} / (tp_size {sizes.tp} x pp_size {sizes.pp})): expert-parallel ranks are "
            "data-parallel ranks that split the experts"
        )
    return problems


def check_layout(config: ModelConfig, sizes: ParallelSizes, world_size: int) -> None:
    """Raise ConfigError (field `megatron`) naming every way the grid does not fit the model."""
    problems = check_world(sizes, world_size)
    divisible = {
        "num_attention_heads": (config.num_attention_heads, sizes.tp, "tp_size"),
        "num_key_value_heads": (config.num_key_value_heads, sizes.tp, "tp_size"),
        "intermediate_size": (config.intermediate_size, sizes.tp, "tp_size"),
        "num_hidden_layers": (config.num_hidden_layers, sizes.pp, "pp_size"),
    }
    if config.num_moe_layers:
        divisible["num_experts"] = (config.num_experts, sizes.ep, "ep_size")
    for field, (value, size, setting) in divisible.items():
        if value % size:
            problems.append(f"{field} {value} is not divisible by {setting} {size}")
    if sizes.ep > 1 and not config.num_moe_layers:
        problems.append(f"ep_size {sizes.ep} needs a mixture-of-experts model (this one is dense)")
    if config.num_moe_layers and (sizes.tp > 1 or sizes.pp > 1):
        problems.append(
            "tp_size and pp_size must be 1 for a mixture-of-experts model in this build (EP is its parallel axis; "
            "MoE with TP needs sequence parallelism, and the routing-agreement statistic of earlier pipeline "
            "stages does not reach the last one)"
        )
    if problems:
        raise ConfigError("megatron parallel layout: " + "; ".join(problems), field="megatron")


@dataclass(frozen=True)
class RankLayout:
    """This process's coordinates in the grid (read from megatron's parallel_state once it is initialised)."""

    world_size: int
    sizes: ParallelSizes
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    ep_rank: int = 0
    expert_dp_rank: int = 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.sizes.pp - 1

    @property
    def reports_stats(self) -> bool:
        """One rank per data-parallel replica reports step statistics: the last stage (where the loss is) at TP
        rank 0 (the other TP ranks compute the same loss from the same gathered logits)."""
        return self.last_stage and self.tp_rank == 0


def comm_device() -> str:
    """Where tensors the backend sends itself must live: "cuda" under nccl (it moves only GPU tensors), else
    "cpu" (gloo)."""
    import torch.distributed as dist

    return "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"


def init_model_parallel(sizes: ParallelSizes) -> RankLayout:
    """Initialise megatron's parallel groups over the default process group (a single-rank gloo group is
    created when none exists: in-process tests and world_size 1) and return this rank's place."""
    import torch.distributed as dist
    from megatron.core import parallel_state  # type: ignore[import-untyped]

    if not dist.is_initialized():
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tp,
            pipeline_model_parallel_size=sizes.pp,
            expert_model_parallel_size=sizes.ep,
        )
    current = ParallelSizes(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
    )
    if current != sizes:
        raise RuntimeError(f"megatron's parallel state is already initialised as {current}, not {sizes}")
    return RankLayout(
        world_size=dist.get_world_size(),
        sizes=sizes,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        expert_dp_rank=parallel_state.get_expert_data_parallel_rank(),
    )
