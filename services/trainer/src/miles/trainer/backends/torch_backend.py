"""The torch backend: the engine's own model code (`miles.model.CausalLM`), trained through autograd.

Logprobs come from exactly the functions the engine uses (`CausalLM.forward_segments` for a packed forward,
`miles.model.block_logprobs` for the LM head and the temperature-scaled log-softmax), so in deterministic mode
a recomputed logprob is bit-identical to what a deterministic engine reported for the same weights.

- Packing: a micro-batch's sequences are `Segment`s of one `forward_segments` call (row-wise work batched,
  attention per sequence), so nothing is padded.
- dtype: float32, or bfloat16 autocast over float32 master weights (logprobs then differ from the engine's).
- Gradient checkpointing: each LM-head/log-softmax block (vocabulary-sized, the largest activation of a small
  model) and each decoder layer's row-wise parts are recomputed in backward (`torch.utils.checkpoint`).
- MoE routing replay (R3, `torch_routing.py`): a sample carrying routing is fed without its last token and, when
  the job replays, with its recorded experts (policy, reference model and the pi_old scoring pass alike); the
  router's own picks give the routing-agreement statistic, replayed or not.
- FSDP2 (`fully_shard`) when world_size > 1, gloo on the CPU, nccl on GPUs. The whole policy is one FSDP unit
  (miles.model calls its layers' row-wise functions directly, so per-layer units would never see a forward
  hook): parameters are all-gathered for the forward and gradients reduce-scattered after backward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from miles.common.errors import ConfigError
from miles.common.jobspec.trainer import TrainConfig
from miles.model import CausalLM, Segment, block_logprobs, load_model, load_named_tensors, row_blocks
from miles.model.moe import SparseMoeBlock
from miles.trainer.backends.base import ModelShape, TokenOutputs, TrainBackend, resolve_routing_replay
from miles.trainer.backends.common import (
    PackedRows,
    build_optimizer,
    full_optimizer_state,
    global_grad_norm,
    load_full_optimizer_state,
    packed_rows,
)
from miles.trainer.backends.torch_routing import (
    RecordedRouting,
    model_routing_shape,
    recorded_routing,
    replay_ids,
    routing_agreement,
)
from miles.trainer.batch import TrainSample
from miles.trainer.losses import entropy_from_logprobs

if TYPE_CHECKING:
    from miles.trainer.settings import TrainerSettings

_PREFIX = "lm."


def _checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: torch.Tensor) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args)
        return checkpoint(fn, *args, use_reentrant=False)

    return run


def enable_layer_checkpointing(lm: CausalLM) -> None:
    """Recompute each decoder layer's row-wise functions (projections, norms, MLP) in backward."""
    for module in lm.model.layers:
        layer: Any = module
        # Instance attributes shadow the methods miles.model's forward calls (see the report: a forward hook
        # for this in miles.model would be cleaner).
        layer.project_qkv = _checkpointed(layer.project_qkv)
        layer.finish = _checkpointed(layer.finish)


class PackedPolicy(nn.Module):
    """The module FSDP wraps: one packed forward from token ids to per-token logprobs and entropies, and the
    router's own top-k of every fed row ((rows, num_moe_layers, top_k) int32; (rows, 0, 0) for a dense model)."""

    def __init__(self, lm: CausalLM, *, deterministic: bool, bf16: bool, checkpointing: bool) -> None:
        super().__init__()
        self.lm = lm
        self.deterministic = deterministic
        self.bf16 = bf16
        self.checkpointing = checkpointing
        # A plain list: the blocks stay registered once, under lm.
        self.moe_blocks: list[SparseMoeBlock] = [m for m in lm.modules() if isinstance(m, SparseMoeBlock)]

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.lm.lm_head_weight.device.type, dtype=torch.bfloat16)

    def forward(
        self,
        token_ids: list[torch.Tensor],
        rows: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        entropy_grad: bool,
        routed_experts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`routed_experts`: (fed rows, num_moe_layers, top_k) expert ids to replay, or None (own routing)."""
        device = self.lm.lm_head_weight.device
        replay = None if routed_experts is None else routed_experts.to(device)
        with self._autocast():
            segments = [Segment(ids.to(device)) for ids in token_ids]
            output = self.lm.forward_routed(segments, deterministic=self.deterministic, routed_experts=replay)
            hidden = output.hidden[rows.to(device)]
            logprobs, entropy = self._token_logprobs(hidden, targets.to(device), temperature, entropy_grad)
            if self.moe_blocks and torch.is_grad_enabled():
                logprobs = logprobs + 0.0 * self._expert_anchor()
            return logprobs, entropy, output.routed_experts

    def _expert_anchor(self) -> torch.Tensor:
        """A zero-weighted sum over every expert and router parameter, added to the logprobs so that each gets a
        gradient (zero when unused) in every backward. Without it, an expert no token of a micro-batch chose
        has no gradient on that rank, FSDP2 leaves it out of its gradient reduce-scatter and the ranks' collectives
        no longer match (and AdamW would treat it differently than Megatron's always-present expert gradients)."""
        sums = [parameter.sum() for block in self.moe_blocks for parameter in block.parameters()]
        return torch.stack(sums).sum().float()

    def _token_logprobs(
        self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def block(h: torch.Tensor, t: torch.Tensor, temps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logprobs = block_logprobs(self.lm, h, temps, deterministic=self.deterministic)
            picked = logprobs.gather(1, t[:, None])[:, 0]
            entropy = entropy_from_logprobs(logprobs if entropy_grad else logprobs.detach())
            return picked, entropy

        run = _checkpointed(block) if self.checkpointing else block
        temps = torch.full((hidden.shape[0],), temperature, dtype=torch.float32, device=hidden.device)
        pieces = [
            run(hidden[r], targets[r], temps[r]) for r in row_blocks(hidden.shape[0], deterministic=self.deterministic)
        ]
        if not pieces:
            empty = hidden.new_zeros(0, dtype=torch.float32)
            return empty, empty
        return torch.cat([p[0] for p in pieces]).float(), torch.cat([p[1] for p in pieces]).float()


class TorchBackend(TrainBackend):
    name = "torch"

    def __init__(self, lm: CausalLM, train: TrainConfig, *, reference: CausalLM | None, distributed: bool) -> None:
        self.train_config = train
        self.distributed = distributed
        self.shape = ModelShape(
            vocab_size=lm.config.vocab_size,
            max_positions=lm.config.max_position_embeddings,
            routing=model_routing_shape(lm.config),
        )
        self.routing_replay = resolve_routing_replay(train, self.shape.routing)
        self.lora = train.lora
        if self.lora is not None:
            if distributed:
                raise ConfigError("train.lora runs in a single trainer process (world_size 1)", field="train.lora")
            from miles.trainer.backends.torch_lora import apply_lora  # peft (and transformers): LoRA jobs only

            apply_lora(lm, self.lora, seed=train.seed)
        if train.gradient_checkpointing:
            enable_layer_checkpointing(lm)
        self.policy = PackedPolicy(
            lm,
            deterministic=train.deterministic,
            bf16=train.dtype == "bfloat16",
            checkpointing=train.gradient_checkpointing,
        )
        if distributed:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.policy)
        self.policy.train()
        self.reference = reference
        self.optimizer, self.scheduler = build_optimizer(self.policy.parameters(), train.optimizer, train.num_steps)

    @classmethod
    def from_settings(cls, settings: TrainerSettings, train: TrainConfig) -> TorchBackend:
        assert settings.model_path is not None
        device = _device(settings.device)
        lm = load_model(settings.model_path).to(device)
        reference = None
        if train.loss.kl_coef > 0:
            reference = load_model(settings.model_path).to(device).requires_grad_(False)
        return cls(lm, train, reference=reference, distributed=settings.world_size > 1)

    def forward(self, samples: Sequence[TrainSample], *, temperature: float, entropy_grad: bool) -> TokenOutputs:
        packed, recorded, replay = self._pack(samples)
        logprobs, entropy, picks = self.policy(
            packed.token_ids, packed.rows, packed.targets, temperature, entropy_grad, replay
        )
        agreement = None if recorded is None else routing_agreement(picks, recorded)
        return TokenOutputs(logprobs=logprobs.cpu(), entropy=entropy.cpu(), routing_agreement=agreement)

    @torch.no_grad()
    def reference_logprobs(self, samples: Sequence[TrainSample], *, temperature: float) -> torch.Tensor:
        assert self.reference is not None, "no reference model: kl_coef is 0"
        packed, _, replay = self._pack(samples)
        reference = PackedPolicy(
            self.reference, deterministic=self.policy.deterministic, bf16=self.policy.bf16, checkpointing=False
        )
        logprobs, _, _ = reference(packed.token_ids, packed.rows, packed.targets, temperature, False, replay)
        result: torch.Tensor = logprobs.cpu()
        return result

    def _pack(self, samples: Sequence[TrainSample]) -> tuple[PackedRows, RecordedRouting | None, torch.Tensor | None]:
        """The packed micro-batch, where its recorded routing sits, and the ids to replay (None: own routing)."""
        packed = packed_rows(samples, trim_routed=True)
        routing = self.shape.routing
        if routing is None:
            return packed, None, None
        recorded = recorded_routing(samples, packed.token_ids, routing)
        if recorded is None or not self.routing_replay:
            return packed, recorded, None
        num_rows = sum(ids.shape[0] for ids in packed.token_ids)
        return packed, recorded, replay_ids(recorded, num_rows, routing)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, grad_clip_norm: float | None) -> float:
        norm = global_grad_norm(self.policy.parameters(), grad_clip_norm)
        self.optimizer.step()
        return norm

    def advance_schedule(self) -> None:
        self.scheduler.step()

    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """With LoRA: the merged weights (torch_lora.merged_hf_tensors), what the engines serve."""
        if self.lora is not None:
            from miles.trainer.backends.torch_lora import merged_hf_tensors

            return merged_hf_tensors(self.policy.lm)
        if not self.distributed:
            return {name: p.detach().float().cpu().clone() for name, p in self.policy.lm.named_parameters()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.policy, options=options)
        return {name.removeprefix(_PREFIX): t.float() for name, t in full.items() if isinstance(t, torch.Tensor)}

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.lora is not None:
            raise ConfigError("a LoRA policy loads its adapter, not full weights (its base is model_path's)")
        if not self.distributed:
            load_named_tensors(self.policy.lm, tensors, require_all=True)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.policy, {_PREFIX + n: t for n, t in tensors.items()}, options=options)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """With LoRA only the adapter (PEFT names): the frozen base is model_path's."""
        if self.lora is not None:
            from miles.trainer.backends.torch_lora import adapter_tensors

            return adapter_tensors(self.policy.lm)
        return self.hf_state_dict()

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.lora is not None:
            from miles.trainer.backends.torch_lora import load_adapter_tensors

            load_adapter_tensors(self.policy.lm, tensors)
            return
        self.load_hf_state_dict(tensors)

    def optimizer_state(self) -> dict[str, Any]:
        return full_optimizer_state(self.policy, self.optimizer, self.scheduler)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        load_full_optimizer_state(self.policy, self.optimizer, self.scheduler, state, distributed=self.distributed)

    def sharded_state(self) -> dict[str, Any] | None:
        """This rank's shards, nothing gathered (FSDP2's DTensors; plain tensors at world_size 1). Creates AdamW's
        state first when no step ran yet (torch's helper runs a zero-lr step on zero gradients)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.policy, self.optimizer)
        return {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.policy, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        self.scheduler.load_state_dict(state["scheduler"])

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.policy.lm.named_parameters()


def _device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def load_policy(model_path: Path, train: TrainConfig) -> TorchBackend:
    """A single-process torch backend over a checkpoint directory (tests, benchmarks, tools)."""
    reference = load_model(model_path).requires_grad_(False) if train.loss.kl_coef > 0 else None
    return TorchBackend(load_model(model_path), train, reference=reference, distributed=False)
