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
- PPO with a critic (`train.critic`, `torch_critic.py`): a value head inside the policy module gives every
  response token's V(prefix) from the same forward; it has its own AdamW parameter group (`critic.lr`), is in
  checkpoints and never in the published weights.
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
from miles.trainer.backends.torch_critic import VALUE_HEAD, ValueHead, check_critic_tensors, split_critic_tensors
from miles.trainer.backends.torch_routing import (
    RecordedRouting,
    model_routing_shape,
    recorded_routing,
    replay_ids,
    routing_agreement,
)
from miles.trainer.batch import TrainSample
from miles.trainer.checkpoint import CRITIC_PREFIX
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
    """The module FSDP wraps: one packed forward from token ids to per-token logprobs and entropies, the router's
    own top-k of every fed row ((rows, num_moe_layers, top_k) int32; (rows, 0, 0) for a dense model) and, with a
    value head, per-token values (else None)."""

    def __init__(
        self,
        lm: CausalLM,
        *,
        deterministic: bool,
        bf16: bool,
        checkpointing: bool,
        value_head: ValueHead | None = None,
        shared_trunk: bool = False,
    ) -> None:
        """`shared_trunk`: the value head's gradient flows into the policy's weights (else it sees detached hidden
        states)."""
        super().__init__()
        self.lm = lm
        self.value_head = value_head
        self.shared_trunk = shared_trunk
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`routed_experts`: (fed rows, num_moe_layers, top_k) expert ids to replay, or None (own routing)."""
        device = self.lm.lm_head_weight.device
        replay = None if routed_experts is None else routed_experts.to(device)
        with self._autocast():
            segments = [Segment(ids.to(device)) for ids in token_ids]
            output = self.lm.forward_routed(segments, deterministic=self.deterministic, routed_experts=replay)
            hidden = output.hidden[rows.to(device)]
            logprobs, entropy = self._token_logprobs(hidden, targets.to(device), temperature, entropy_grad)
            values = None
            if self.value_head is not None:
                values = self.value_head(hidden if self.shared_trunk else hidden.detach())
            if self.moe_blocks and torch.is_grad_enabled():
                logprobs = logprobs + 0.0 * self._expert_anchor()
            return logprobs, entropy, output.routed_experts, values

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
        critic = train.critic
        self.policy = PackedPolicy(
            lm,
            deterministic=train.deterministic,
            bf16=train.dtype == "bfloat16",
            checkpointing=train.gradient_checkpointing,
            value_head=ValueHead(lm.config.hidden_size, lm.lm_head_weight.device) if critic is not None else None,
            shared_trunk=critic is not None and critic.shared_trunk,
        )
        if distributed:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.policy)
        self.policy.train()
        self.reference = reference
        own_lr = []
        if critic is not None and self.policy.value_head is not None:
            own_lr.append((list(self.policy.value_head.parameters()), critic.lr or train.optimizer.lr))
        self.optimizer, self.scheduler = build_optimizer(
            self.policy.parameters(), train.optimizer, train.num_steps, own_lr=own_lr
        )

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
        logprobs, entropy, picks, values = self.policy(
            packed.token_ids, packed.rows, packed.targets, temperature, entropy_grad, replay
        )
        agreement = None if recorded is None else routing_agreement(picks, recorded)
        return TokenOutputs(
            logprobs=logprobs.cpu(),
            entropy=entropy.cpu(),
            routing_agreement=agreement,
            values=None if values is None else values.cpu(),
        )

    @torch.no_grad()
    def reference_logprobs(self, samples: Sequence[TrainSample], *, temperature: float) -> torch.Tensor:
        assert self.reference is not None, "no reference model: kl_coef is 0"
        packed, _, replay = self._pack(samples)
        reference = PackedPolicy(
            self.reference, deterministic=self.policy.deterministic, bf16=self.policy.bf16, checkpointing=False
        )
        logprobs, _, _, _ = reference(packed.token_ids, packed.rows, packed.targets, temperature, False, replay)
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
        """The policy's gradient norm (clipped over the policy's parameters); a value head's gradient is clipped on
        its own, so that the critic's regression never scales the policy's update down."""
        head = self.policy.value_head
        if head is None:
            norm = global_grad_norm(self.policy.parameters(), grad_clip_norm)
        else:
            head_ids = {id(p) for p in head.parameters()}
            norm = global_grad_norm([p for p in self.policy.parameters() if id(p) not in head_ids], grad_clip_norm)
            global_grad_norm(head.parameters(), grad_clip_norm)
        self.optimizer.step()
        return norm

    def advance_schedule(self) -> None:
        self.scheduler.step()

    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights, what the engines serve (never the value head); with LoRA the merged weights
        (torch_lora.merged_hf_tensors)."""
        if self.lora is not None:
            from miles.trainer.backends.torch_lora import merged_hf_tensors

            return merged_hf_tensors(self.policy.lm)
        full = self._full_tensors()
        return {name.removeprefix(_PREFIX): t for name, t in full.items() if name.startswith(_PREFIX)}

    def _full_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter of the policy module (`lm.` names, and `value_head.` ones with a critic), whole, float32
        on the CPU (gathered under FSDP: collective)."""
        if not self.distributed:
            return {name: p.detach().float().cpu().clone() for name, p in self.policy.named_parameters()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.policy, options=options)
        return {name: t.float() for name, t in full.items() if isinstance(t, torch.Tensor)}

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the policy's weights (a value head keeps its own)."""
        if self.lora is not None:
            raise ConfigError("a LoRA policy loads its adapter, not full weights (its base is model_path's)")
        self._load_full(tensors, {})

    def _load_full(self, weights: dict[str, torch.Tensor], head: dict[str, torch.Tensor]) -> None:
        """Policy weights (Hugging Face names) and, when given, value-head tensors (its parameter names); collective
        under FSDP, where the tensors are read on rank 0."""
        if not self.distributed:
            load_named_tensors(self.policy.lm, weights, require_all=True)
            if head and self.policy.value_head is not None:
                with torch.no_grad():
                    for name, param in self.policy.value_head.named_parameters():
                        param.copy_(head[f"{VALUE_HEAD}.{name}"])
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # With a value head, rank 0 may hold the policy's weights only (load_hf_state_dict): not strict then.
        strict = self.policy.value_head is None
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        state: dict[str, Any] = {_PREFIX + n: t for n, t in weights.items()} | head
        set_model_state_dict(self.policy, state, options=options)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The policy's weights and, with a critic, the value head under `critic.` names (checkpoint.py writes those
        apart); with LoRA only the adapter (PEFT names): the frozen base is model_path's."""
        if self.lora is not None:
            from miles.trainer.backends.torch_lora import adapter_tensors

            return adapter_tensors(self.policy.lm)
        full = self._full_tensors()
        return {
            name.removeprefix(_PREFIX) if name.startswith(_PREFIX) else CRITIC_PREFIX + name: t
            for name, t in full.items()
        }

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what checkpoint_tensors returned (the value head too). Raises ConfigError when the checkpoint's
        value head does not fit the job (one without the other)."""
        if self.lora is not None:
            from miles.trainer.backends.torch_lora import load_adapter_tensors

            load_adapter_tensors(self.policy.lm, tensors)
            return
        weights, head = split_critic_tensors(tensors)
        if weights:  # the process that read the checkpoint (rank 0 under FSDP)
            check_critic_tensors(head, self.policy.value_head is not None)
        self._load_full(weights, head)

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
