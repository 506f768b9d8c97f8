"""The Megatron backend: a megatron-core GPTModel built from the Hugging Face config, with HF weights mapped in
and out (`megatron_mapping.py`), trained with torch.optim AdamW.

Megatron has no type hints: everything it returns stays inside this module behind `TrainBackend`'s typed
methods. On a machine without CUDA `cpu_compat.apply_cpu_compat()` is applied first (only then).

- Micro-batches are right-padded to the longest sequence ([batch, seq]) with an explicit causal mask (the local
  attention has no packed/THD path; with a causal mask padding never influences real tokens).
- dtype: float32, or bfloat16 autocast over float32 weights, like the torch backend.
- Parallelism (`megatron_parallel.py`): TP, PP, DP = world_size / (TP x PP) and, for MoE, EP (carved out of DP).
  Each rank builds only its pipeline stage, its experts and its TP slices, reading only the HF tensors those are
  made of (`megatron_shards.py`); logits are gathered over TP (`parallel_output=False`, vocabulary padded to a
  multiple of TP and cut back), so every TP rank of the last stage computes the same token outputs and loss. PP
  runs megatron-core's 1F1B schedule with the loss on the last stage (`megatron_schedule.py`); gradients are
  made whole by our own all-reduces (DP, EP, tied embeddings, q/k norms), not megatron's DDP wrapper. Weights and
  optimizer state are gathered to / scattered from rank 0 in the single-rank formats (`megatron_state.py`).
  At world_size 1 nothing of this runs: the model is one whole GPTModel, as before.
- Gradient checkpointing maps to Megatron's full per-layer recomputation, which needs CUDA RNG states: refused
  on the CPU.
- Qwen3-MoE (`megatron_moe.py`): megatron-core's MoE layers (router, SequentialMLP experts split over EP ranks
  behind the allgather dispatcher) on the sparse layers, dense MLPs on the others; recorded routing is replayed
  through megatron-core's RouterReplay, and
  `TokenOutputs.routing_agreement` says how often the router's own top-k matched the recorded one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

from miles.common.errors import ConfigError
from miles.common.jobspec.trainer import TrainConfig
from miles.model import ModelConfig, read_safetensors_dir
from miles.trainer.backends.base import (
    Consume,
    DataRanks,
    ModelShape,
    TokenOutputs,
    TrainBackend,
    resolve_routing_replay,
)
from miles.trainer.backends.common import (
    build_optimizer,
    full_optimizer_state,
    global_grad_norm,
    load_full_optimizer_state,
)
from miles.trainer.backends.cpu_compat import apply_cpu_compat
from miles.trainer.backends.megatron_mapping import AttentionLayout, hf_to_megatron, megatron_tensor, megatron_to_hf
from miles.trainer.backends.megatron_model import build_gpt_model
from miles.trainer.backends.megatron_moe import RouterReplays, recorded_routing
from miles.trainer.backends.megatron_parallel import ParallelSizes, check_layout, comm_device, init_model_parallel
from miles.trainer.backends.megatron_schedule import (
    OutputsOf,
    clip_grad_norm,
    finalize_grads,
    pipeline_forward,
    pipeline_micro_batches,
    pipeline_references,
)
from miles.trainer.backends.megatron_shards import LazyCheckpoint, load_local, shard_specs
from miles.trainer.backends.megatron_state import (
    gathered_hf_state,
    gathered_optimizer_state,
    load_gathered_optimizer_state,
    scatter_hf_state,
)
from miles.trainer.backends.torch_routing import model_routing_shape
from miles.trainer.batch import TrainSample
from miles.trainer.losses import entropy_from_logprobs

if TYPE_CHECKING:
    from miles.trainer.settings import TrainerSettings


class MegatronBackend(TrainBackend):
    name = "megatron"

    def __init__(
        self,
        config: ModelConfig,
        hf_tensors: Mapping[str, torch.Tensor] | LazyCheckpoint,
        train: TrainConfig,
        *,
        sizes: ParallelSizes = ParallelSizes(),
    ) -> None:
        """`hf_tensors`: the HF checkpoint's tensors (every rank reads the ones its shards are made of)."""
        on_cpu = apply_cpu_compat()
        if on_cpu and train.gradient_checkpointing:
            raise ConfigError(
                "megatron backend: gradient checkpointing needs CUDA", field="train.gradient_checkpointing"
            )
        self.replay = resolve_routing_replay(train, model_routing_shape(config))
        if self.replay and train.gradient_checkpointing:
            raise ConfigError(
                "megatron backend: gradient checkpointing with MoE routing replay is not driven (recomputation "
                "would need RouterReplay's backward action)",
                field="train.gradient_checkpointing",
            )
        check_layout(config, sizes, dist.get_world_size() if dist.is_initialized() else 1)
        self.ranks = init_model_parallel(sizes)
        self.distributed = self.ranks.world_size > 1
        self.config = config
        self.train_config = train
        self.attention = AttentionLayout(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.shape = ModelShape(
            vocab_size=config.vocab_size,
            max_positions=config.max_position_embeddings,
            routing=model_routing_shape(config),
        )
        self.device = torch.device("cpu" if on_cpu else "cuda")
        self.model: Any = build_gpt_model(config, train, self.ranks).to(self.device)
        self.specs = shard_specs(self.model, self.ranks, config) if self.distributed else {}
        self.params = [(self.specs[name], param) for name, param in self.model.named_parameters() if self.specs]
        self._load_initial(self.model, hf_tensors)
        self.routers = self._routers(self.model)
        self.reference: Any = None
        self.reference_routers: RouterReplays | None = None
        if train.loss.kl_coef > 0:
            self.reference = build_gpt_model(config, train, self.ranks).to(self.device)
            self._load_initial(self.reference, hf_tensors)
            self.reference.requires_grad_(False)
            self.reference_routers = self._routers(self.reference)
        self.model.train()
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), train.optimizer, train.num_steps)

    @classmethod
    def from_settings(cls, settings: TrainerSettings, train: TrainConfig) -> MegatronBackend:
        assert settings.model_path is not None
        megatron = settings.megatron
        sizes = ParallelSizes(tp=megatron.tp_size, pp=megatron.pp_size, ep=megatron.ep_size)
        # Several ranks: each reads only the tensors of its own shards (memory-mapped), never the whole model.
        source: Mapping[str, torch.Tensor] | LazyCheckpoint = (
            LazyCheckpoint(settings.model_path)
            if settings.world_size > 1
            else read_safetensors_dir(settings.model_path)
        )
        try:
            return cls(ModelConfig.from_dir(settings.model_path), source, train, sizes=sizes)
        finally:
            if isinstance(source, LazyCheckpoint):
                source.close()

    def _load_initial(self, model: Any, source: Mapping[str, torch.Tensor] | LazyCheckpoint) -> None:
        if not self.distributed:
            assert isinstance(source, Mapping)
            self._load_into(model, source)
            return
        specs = [(self.specs[name], param.data) for name, param in model.named_parameters()]
        load_local(specs, lambda name: megatron_tensor(name, source.__getitem__, self.attention))

    def data_ranks(self, rank: int, world_size: int) -> DataRanks:
        """Data-parallel rank and size: TP and PP peers train the same micro-batches."""
        return DataRanks(self.ranks.dp_rank, self.ranks.dp_size, reports_stats=self.ranks.reports_stats)

    def _routers(self, model: Any) -> RouterReplays | None:
        return RouterReplays(model, self.shape.routing) if self.shape.routing is not None else None

    def _batch_shape(self, samples: Sequence[TrainSample]) -> tuple[int, int]:
        """[batch, max_len] of the right-padded micro-batch; with EP > 1 the largest of the expert-parallel group
        (megatron's allgather dispatcher gathers equal token counts from every EP rank)."""
        shape = torch.tensor([len(samples), max(len(s.tokens) for s in samples)], device=comm_device())
        if self.ranks.sizes.ep > 1:
            from megatron.core import parallel_state  # type: ignore[import-untyped]

            group = parallel_state.get_expert_tensor_and_model_parallel_group()
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
        return int(shape[0]), int(shape[1])

    def _stage_forward(
        self, model: Any, samples: Sequence[TrainSample], shape: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """This stage's output: the real vocabulary's float32 logits on the last stage, hidden states before.
        Rows and columns beyond the samples (`shape`) are zeros: causal attention within a row and per-token
        experts keep them out of every real position."""
        batch, max_len = shape if shape is not None else self._batch_shape(samples)
        ids = torch.zeros((batch, max_len), dtype=torch.long)
        for row, sample in enumerate(samples):
            ids[row, : len(sample.tokens)] = torch.tensor(sample.tokens)
        positions = torch.arange(max_len).unsqueeze(0).expand(batch, -1)
        causal_mask = torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), diagonal=1)[None, None]
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.train_config.dtype == "bfloat16")
        with autocast:
            output: torch.Tensor = model(
                ids.to(self.device), positions.to(self.device), attention_mask=causal_mask.to(self.device)
            )
        if not self.ranks.last_stage:
            return output
        return output.float()[..., : self.config.vocab_size]

    def _logits(
        self, model: Any, routers: RouterReplays | None, samples: Sequence[TrainSample]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[batch, max_len, vocab] logits of the right-padded micro-batch (one pipeline stage), and the
        per-MoE-layer routing agreement (None for a dense model or samples without recorded routing)."""
        shape = self._batch_shape(samples)
        if routers is None:
            return self._stage_forward(model, samples, shape), None
        routing = recorded_routing(samples, shape[1], routers.shape, batch=shape[0])
        return routers.run(lambda: self._stage_forward(model, samples, shape), routing, replay=self.replay)

    def _token_outputs(
        self, logits: torch.Tensor, samples: Sequence[TrainSample], temperature: float, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        picked, entropies = [], []
        for row, sample in enumerate(samples):
            start = max(sample.response_start, 1)
            rows = torch.arange(start - 1, len(sample.tokens) - 1)
            if sample.response_start == 0:
                rows = torch.cat([torch.zeros(1, dtype=torch.long), rows])
            targets = torch.tensor(sample.tokens[sample.response_start :], device=logits.device)
            logprobs = F.log_softmax(logits[row, rows.to(logits.device)] / temperature, dim=-1)
            picked.append(logprobs.gather(1, targets[:, None])[:, 0])
            entropies.append(entropy_from_logprobs(logprobs if entropy_grad else logprobs.detach()))
        return torch.cat(picked).cpu(), torch.cat(entropies).cpu()

    def forward(self, samples: Sequence[TrainSample], *, temperature: float, entropy_grad: bool) -> TokenOutputs:
        """One micro-batch. With PP > 1 a forward-only pass through the pipeline whose outputs the last stage
        broadcasts to its pipeline peers (not differentiable: training goes through `run_micro_batches`)."""
        if self.ranks.sizes.pp > 1:
            return self._pipeline_forward(self.model, samples, temperature)
        logits, agreement = self._logits(self.model, self.routers, samples)
        logprobs, entropy = self._token_outputs(logits, samples, temperature, entropy_grad)
        return TokenOutputs(logprobs=logprobs, entropy=entropy, routing_agreement=agreement)

    @torch.no_grad()
    def reference_logprobs(self, samples: Sequence[TrainSample], *, temperature: float) -> torch.Tensor:
        assert self.reference is not None, "no reference model: kl_coef is 0"
        if self.ranks.sizes.pp > 1:
            return self._pipeline_forward(self.reference, samples, temperature).logprobs
        logits, _ = self._logits(self.reference, self.reference_routers, samples)
        return self._token_outputs(logits, samples, temperature, False)[0]

    def _outputs_of(self, temperature: float) -> OutputsOf:
        return lambda logits, samples, grad: self._token_outputs(logits, samples, temperature, grad)

    def run_micro_batches(
        self,
        micro_batches: Sequence[Sequence[TrainSample]],
        consume: Consume,
        *,
        temperature: float,
        entropy_grad: bool,
        backward: bool,
    ) -> None:
        """PP > 1: megatron's 1F1B schedule; `consume` runs on the last stage, where the logits are."""
        if self.ranks.sizes.pp == 1:
            super().run_micro_batches(
                micro_batches, consume, temperature=temperature, entropy_grad=entropy_grad, backward=backward
            )
            return
        outputs_of = self._outputs_of(temperature)
        pipeline_micro_batches(
            self.model,
            micro_batches,
            self._stage_forward,
            outputs_of,
            consume,
            entropy_grad=entropy_grad,
            backward=backward,
        )

    @torch.no_grad()
    def reference_batches(
        self, micro_batches: Sequence[Sequence[TrainSample]], *, temperature: float
    ) -> list[torch.Tensor | None]:
        if self.ranks.sizes.pp == 1:
            return super().reference_batches(micro_batches, temperature=temperature)
        assert self.reference is not None, "no reference model: kl_coef is 0"
        return pipeline_references(self.reference, micro_batches, self._stage_forward, self._outputs_of(temperature))

    def _pipeline_forward(self, model: Any, samples: Sequence[TrainSample], temperature: float) -> TokenOutputs:
        return pipeline_forward(model, samples, self._stage_forward, self._outputs_of(temperature))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, grad_clip_norm: float | None) -> float:
        if not self.distributed:
            norm = global_grad_norm(self.model.parameters(), grad_clip_norm)
        else:
            finalize_grads(self.params, self.ranks, qk_norm=self.config.qk_norm, tied=self.config.tie_word_embeddings)
            norm = clip_grad_norm(self.params, grad_clip_norm)
        self.optimizer.step()
        return norm

    def advance_schedule(self) -> None:
        self.scheduler.step()

    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        if self.distributed:
            return gathered_hf_state(self.params, self.config, self.attention)
        state = {
            name: tensor.detach().float().cpu().clone()
            for name, tensor in self.model.state_dict().items()
            if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state")
        }
        return megatron_to_hf(
            state, self.attention, self.config.num_hidden_layers, tied=self.config.tie_word_embeddings
        )

    def _load_into(self, model: Any, tensors: Mapping[str, torch.Tensor]) -> None:
        relevant = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            relevant.pop("lm_head.weight", None)
        mapped = hf_to_megatron(
            relevant, self.attention, self.config.num_hidden_layers, tied=self.config.tie_word_embeddings
        )
        own = model.state_dict()
        unknown = sorted(set(mapped) - set(own))
        missing = sorted(k for k in own if k not in mapped and not k.endswith("_extra_state"))
        if unknown or missing:
            raise ValueError(f"weight mapping mismatch: unknown {unknown[:3]}, missing {missing[:3]}")
        with torch.no_grad():
            for name, tensor in mapped.items():
                if tuple(own[name].shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(own[name].shape)}")
                own[name].copy_(tensor.to(own[name].dtype))

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Collective; with several ranks the tensors are read on rank 0 only and scattered shard by shard."""
        if self.distributed:
            scatter_hf_state([(spec, param.data) for spec, param in self.params], tensors, self.attention)
            return
        self._load_into(self.model, tensors)

    def optimizer_state(self) -> dict[str, Any]:
        if self.distributed:
            return gathered_optimizer_state(self.params, self.optimizer, self.scheduler)
        return full_optimizer_state(self.model, self.optimizer, self.scheduler)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        if self.distributed:
            load_gathered_optimizer_state(self.params, self.optimizer, self.scheduler, state)
            return
        load_full_optimizer_state(self.model, self.optimizer, self.scheduler, state, distributed=False)
