"""The Megatron backend: a megatron-core GPTModel built from the Hugging Face config, with HF weights mapped in
and out (`megatron_mapping.py`), trained with torch.optim AdamW.

Megatron has no type hints: everything it returns stays inside this module behind `TrainBackend`'s typed
methods. On a machine without CUDA `cpu_compat.apply_cpu_compat()` is applied first (only then).

- Micro-batches are right-padded to the longest sequence ([batch, seq]) with an explicit causal mask (the local
  attention has no packed/THD path; with a causal mask padding never influences real tokens).
- dtype: float32, or bfloat16 autocast over float32 weights, like the torch backend.
- Parallelism: tensor/pipeline sizes are passed to parallel_state and the TransformerConfig; this build drives
  TP = PP = 1 only (a multi-rank Megatron driver with sharded weight mapping is not built) and refuses others.
- Gradient checkpointing maps to Megatron's full per-layer recomputation, which needs CUDA RNG states: refused
  on the CPU.
- Qwen3-MoE (`megatron_moe.py`): megatron-core's MoE layers (router, SequentialMLP experts, EP = 1) on the sparse
  layers, dense MLPs on the others; recorded routing is replayed through megatron-core's RouterReplay, and
  `TokenOutputs.routing_agreement` says how often the router's own top-k matched the recorded one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F  # noqa: N812

from miles.common.errors import ConfigError
from miles.common.jobspec.trainer import TrainConfig
from miles.model import ModelConfig, read_safetensors_dir
from miles.trainer.backends.base import ModelShape, TokenOutputs, TrainBackend, resolve_routing_replay
from miles.trainer.backends.common import (
    build_optimizer,
    full_optimizer_state,
    global_grad_norm,
    load_full_optimizer_state,
)
from miles.trainer.backends.cpu_compat import apply_cpu_compat
from miles.trainer.backends.megatron_mapping import AttentionLayout, hf_to_megatron, megatron_to_hf
from miles.trainer.backends.megatron_moe import (
    RouterReplays,
    decoder_block_spec,
    moe_config_fields,
    recorded_routing,
)
from miles.trainer.backends.torch_routing import model_routing_shape
from miles.trainer.batch import TrainSample
from miles.trainer.losses import entropy_from_logprobs

if TYPE_CHECKING:
    from miles.trainer.settings import TrainerSettings


def _ensure_model_parallel(tp: int, pp: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state  # type: ignore[import-untyped]

    if not dist.is_initialized():
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def build_gpt_model(config: ModelConfig, train: TrainConfig, *, tp: int = 1, pp: int = 1) -> Any:
    """A GPTModel with the architecture of `config` (weights uninitialised until loaded); MoE layers replay
    recorded routing when `train.routing_replay` resolves to on."""
    from megatron.core.models.gpt import GPTModel  # type: ignore[import-untyped]
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # type: ignore[import-untyped]
    from megatron.core.transformer.transformer_config import TransformerConfig  # type: ignore[import-untyped]

    on_gpu = torch.cuda.is_available()
    recompute: dict[str, Any] = {}
    if train.gradient_checkpointing:
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    transformer_config = TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        ffn_hidden_size=config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        qk_layernorm=config.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=config.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not on_gpu,
        params_dtype=torch.float32,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        **recompute,
        **moe_config_fields(config, replay=resolve_routing_replay(train, model_routing_shape(config))),
    )
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_norm, normalization="RMSNorm")
    return GPTModel(
        config=transformer_config,
        transformer_layer_spec=decoder_block_spec(config, layer_spec) if config.num_moe_layers else layer_spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(config.rope_theta),
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        pre_process=True,
        post_process=True,
    )


class MegatronBackend(TrainBackend):
    name = "megatron"

    def __init__(
        self, config: ModelConfig, hf_tensors: dict[str, torch.Tensor], train: TrainConfig, *, tp: int = 1, pp: int = 1
    ) -> None:
        if tp != 1 or pp != 1:
            raise ConfigError(
                f"megatron backend: tensor/pipeline parallel sizes {tp}/{pp} are not driven by this build (only 1/1)",
                field="megatron",
            )
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
        _ensure_model_parallel(tp, pp)
        self.config = config
        self.train_config = train
        self.layout = AttentionLayout(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.shape = ModelShape(
            vocab_size=config.vocab_size,
            max_positions=config.max_position_embeddings,
            routing=model_routing_shape(config),
        )
        self.device = torch.device("cpu" if on_cpu else "cuda")
        self.model: Any = build_gpt_model(config, train, tp=tp, pp=pp).to(self.device)
        self.load_hf_state_dict(hf_tensors)
        self.routers = self._routers(self.model)
        self.reference: Any = None
        self.reference_routers: RouterReplays | None = None
        if train.loss.kl_coef > 0:
            self.reference = build_gpt_model(config, train, tp=tp, pp=pp).to(self.device)
            self._load_into(self.reference, hf_tensors)
            self.reference.requires_grad_(False)
            self.reference_routers = self._routers(self.reference)
        self.model.train()
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), train.optimizer, train.num_steps)

    @classmethod
    def from_settings(cls, settings: TrainerSettings, train: TrainConfig) -> MegatronBackend:
        assert settings.model_path is not None
        return cls(
            ModelConfig.from_dir(settings.model_path),
            read_safetensors_dir(settings.model_path),
            train,
            tp=settings.megatron.tensor_model_parallel_size,
            pp=settings.megatron.pipeline_model_parallel_size,
        )

    def _routers(self, model: Any) -> RouterReplays | None:
        return RouterReplays(model, self.shape.routing) if self.shape.routing is not None else None

    def _logits(
        self, model: Any, routers: RouterReplays | None, samples: Sequence[TrainSample]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[batch, max_len, vocab] logits of the right-padded micro-batch, and the per-MoE-layer routing agreement
        (None for a dense model or samples without recorded routing)."""
        max_len = max(len(s.tokens) for s in samples)
        ids = torch.zeros((len(samples), max_len), dtype=torch.long)
        for row, sample in enumerate(samples):
            ids[row, : len(sample.tokens)] = torch.tensor(sample.tokens)
        positions = torch.arange(max_len).unsqueeze(0).expand(len(samples), -1)
        causal_mask = torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), diagonal=1)[None, None]
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.train_config.dtype == "bfloat16")

        def run() -> torch.Tensor:
            with autocast:
                logits: torch.Tensor = model(
                    ids.to(self.device), positions.to(self.device), attention_mask=causal_mask.to(self.device)
                )
            return logits.float()

        if routers is None:
            return run(), None
        routing = recorded_routing(samples, max_len, routers.shape)
        return routers.run(run, routing, replay=self.replay)

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
        logits, agreement = self._logits(self.model, self.routers, samples)
        logprobs, entropy = self._token_outputs(logits, samples, temperature, entropy_grad)
        return TokenOutputs(logprobs=logprobs, entropy=entropy, routing_agreement=agreement)

    @torch.no_grad()
    def reference_logprobs(self, samples: Sequence[TrainSample], *, temperature: float) -> torch.Tensor:
        assert self.reference is not None, "no reference model: kl_coef is 0"
        logits, _ = self._logits(self.reference, self.reference_routers, samples)
        return self._token_outputs(logits, samples, temperature, False)[0]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, grad_clip_norm: float | None) -> float:
        norm = global_grad_norm(self.model.parameters(), grad_clip_norm)
        self.optimizer.step()
        return norm

    def advance_schedule(self) -> None:
        self.scheduler.step()

    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        state = {
            name: tensor.detach().float().cpu().clone()
            for name, tensor in self.model.state_dict().items()
            if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state")
        }
        return megatron_to_hf(state, self.layout, self.config.num_hidden_layers, tied=self.config.tie_word_embeddings)

    def _load_into(self, model: Any, tensors: dict[str, torch.Tensor]) -> None:
        relevant = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            relevant.pop("lm_head.weight", None)
        mapped = hf_to_megatron(
            relevant, self.layout, self.config.num_hidden_layers, tied=self.config.tie_word_embeddings
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
        self._load_into(self.model, tensors)

    def optimizer_state(self) -> dict[str, Any]:
        return full_optimizer_state(self.model, self.optimizer, self.scheduler)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        load_full_optimizer_state(self.model, self.optimizer, self.scheduler, state, distributed=False)
