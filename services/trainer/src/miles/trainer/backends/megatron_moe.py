"""Qwen3-MoE on megatron-core 0.16.1: the TransformerConfig fields and per-layer block spec that reproduce
Hugging Face's sparse block, and routing replay (R3) through megatron-core's own `RouterReplay`.

What Hugging Face computes per token (miles.model.moe): probs = softmax(router logits) over all experts, the
top-k of probs, combine weights = probs at those ids, renormalised iff `norm_topk_prob`; no shared experts, no
bias. megatron-core's softmax router does the same with
- `moe_router_pre_softmax=True` (softmax over all experts, then top-k) when norm_topk_prob is off, and
- `moe_router_pre_softmax=False` (top-k of the logits, then a softmax over the k) when it is on: the same ids
  (softmax is monotone) and the same weights up to float rounding (exp(l_i) / sum over the k of exp(l_j)).
Router logits are computed in float32 (`moe_router_dtype="fp32"`), no auxiliary or z-loss (the torch model has
none), no token dropping. Experts are `SequentialMLP` (local spec; grouped GEMM needs CUDA kernels) behind the
allgather token dispatcher: at expert-parallel size 1 it only permutes; with EP > 1 every rank gathers every EP
rank's tokens (all_gather_into_tensor, which gloo has), runs its own experts on those routed to them and
reduce-scatters the results back. It gathers equal token counts from every rank, so the backend pads each
micro-batch to the largest [batch, length] of the EP group (filler rows and columns feed no output that is used).
The alltoall dispatcher creates a CUDA stream in its constructor, so it cannot even be built on the CPU.
megatron-core 0.16.1 without Transformer Engine needs one patch for MoE (`_patch_missing_te_gemm`).

Replay: each router of a model built with `moe_enable_routing_replay=True` owns a `RouterReplay`. Before a
forward the recorded top-k ids of every MoE layer are set on it (`set_target_indices`) with the action
REPLAY_FORWARD, so the router gathers its *current* probabilities at the recorded ids (the router keeps its
gradient); after the forward they are cleared. Positions without recorded routing (right padding, each sample's
last position, samples that carry none) replay experts 0..k-1: none of them feeds a logprob that is used. The
instances are driven per model, not through RouterReplay's process-wide static list: that list assumes one model
per process, and a backend holds two (the policy and the KL reference) and tests build many; so the handles are
taken out of it.

Agreement: a forward hook on each router compares its own top-k set (recomputed from the same input with
megatron's routing function when replaying; the routing it returned otherwise) with the recorded set, over the
positions that carry recorded routing.

Limits: EP only with TP = PP = 1 (megatron_parallel.check_layout); activation recomputation with replay would
need the REPLAY_BACKWARD action between forward and backward, which this backend does not sequence, so it is
refused.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles.common.contracts.routing import RoutingShape
from miles.model import ModelConfig
from miles.trainer.backends.common import is_routed
from miles.trainer.batch import TrainSample


def moe_config_fields(config: ModelConfig, *, replay: bool) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3-MoE model (empty for a dense one)."""
    if config.num_moe_layers == 0:
        return {}
    sparse = set(config.moe_layer_indices)
    return {
        "num_moe_experts": config.num_experts,
        "moe_router_topk": config.num_experts_per_tok,
        "moe_ffn_hidden_size": config.moe_intermediate_size,
        "moe_layer_freq": [1 if i in sparse else 0 for i in range(config.num_hidden_layers)],
        "moe_router_pre_softmax": not config.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "moe_enable_routing_replay": replay,
    }


def decoder_block_spec(config: ModelConfig, dense_layer_spec: Any) -> Any:
    """The block spec: Megatron's local MoE layer spec on the sparse layers, `dense_layer_spec` elsewhere (a
    list-valued `moe_layer_freq` is what megatron's own block spec builds from; the final norm is the one the
    block picks for a single layer spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # type: ignore[import-untyped]
    from megatron.core.transformer.transformer_block import (  # type: ignore[import-untyped]
        LayerNormImpl,
        TransformerBlockSubmodules,
    )

    _patch_missing_te_gemm()
    moe_spec = get_gpt_layer_local_spec(
        num_experts=config.num_experts, qk_layernorm=config.qk_norm, normalization="RMSNorm"
    )
    sparse = set(config.moe_layer_indices)
    specs = [moe_spec if i in sparse else dense_layer_spec for i in range(config.num_hidden_layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=LayerNormImpl)


def _patch_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router gating (`RouterGatingLinearFunction`) tests `te_general_gemm is not None`,
    a name bound only when Transformer Engine imports: without TE every MoE forward raises NameError. Binding it
    to None selects the torch.mm path it was meant to fall back to. Idempotent; a no-op where TE is installed."""
    from megatron.core.transformer.moe import moe_utils  # type: ignore[import-untyped]

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@dataclass(frozen=True)
class RecordedRouting:
    """Recorded routing laid out like a right-padded micro-batch as megatron flattens it (row s * batch + b for
    position s of sample b): `expert_ids` [num_moe_layers, seq * batch, top_k] int64 and `recorded` [seq * batch]
    bool, true where a sample's routing has a row (every position of a routed sample but its last). Elsewhere
    (padding, last positions, samples without routing) experts 0..k-1 stand in, as in the torch backend: with
    replay on, batch.py lets only samples that are not trained on lack routing; a stand-in position feeds no
    logprob that is used (attention is causal, and each sample is its own row of the batch)."""

    expert_ids: torch.Tensor
    recorded: torch.Tensor


def recorded_routing(
    samples: Sequence[TrainSample], seq_len: int, shape: RoutingShape, *, batch: int = 0
) -> RecordedRouting | None:
    """The samples' recorded routing in micro-batch layout (`batch` rows, default one per sample: rows beyond
    the samples are filler); None when no sample carries any (`is_routed`). Raises ValueError for a wrong length,
    ids outside the model's experts or an expert repeated at a position (megatron's routing map would silently
    route such a position to fewer than k experts)."""
    if not any(is_routed(sample) for sample in samples):
        return None
    batch = max(batch, len(samples))
    filler = torch.arange(shape.top_k, dtype=torch.long)
    ids = filler.expand(shape.num_layers, seq_len, batch, shape.top_k).clone()
    recorded = torch.zeros(seq_len, batch, dtype=torch.bool)
    for b, sample in enumerate(samples):
        if not is_routed(sample):
            continue
        assert sample.routed_experts is not None
        rows = len(sample.tokens) - 1
        flat = _as_tensor(sample.routed_experts)
        if flat.numel() != rows * shape.row_width:
            raise ValueError(
                f"sample {sample.sample_id!r}: {flat.numel()} routed expert ids, need {rows} positions x "
                f"{shape.num_layers} MoE layers x {shape.top_k}"
            )
        ids[:, :rows, b] = flat.reshape(rows, shape.num_layers, shape.top_k).permute(1, 0, 2)
        recorded[:rows, b] = True
    if int(ids.min()) < 0 or int(ids.max()) >= shape.num_experts:
        raise ValueError(f"routed expert ids must be within [0, {shape.num_experts})")
    ordered = ids.sort(dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError("routed experts repeat an expert within a position's top-k")
    return RecordedRouting(ids.reshape(shape.num_layers, seq_len * batch, shape.top_k), recorded.reshape(-1))


def _as_tensor(ids: array[int]) -> torch.Tensor:
    """int64 copy of flat int32 ids (read in place through the buffer protocol: no Python int per id)."""
    if len(ids) == 0 or ids.itemsize != 4:
        return torch.tensor(ids.tolist(), dtype=torch.long)
    return torch.frombuffer(ids, dtype=torch.int32).long()


class RouterReplays:
    """The routers of one GPTModel's MoE layers (ascending layer order: the layer axis of recorded routing), their
    RouterReplay handles (when the model replays) and the agreement hooks."""

    def __init__(self, model: Any, shape: RoutingShape) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer  # type: ignore[import-untyped]
        from megatron.core.transformer.moe.router_replay import RouterReplay  # type: ignore[import-untyped]

        self.shape = shape
        self.routers = [layer.mlp.router for layer in model.decoder.layers if isinstance(layer.mlp, MoELayer)]
        if len(self.routers) != shape.num_layers:
            raise ValueError(f"model has {len(self.routers)} MoE layers, the config {shape.num_layers}")
        self.replays = [r.router_replay for r in self.routers if r.router_replay is not None]
        owned = {id(handle) for handle in self.replays}
        RouterReplay.global_router_replay_instances[:] = [
            handle for handle in RouterReplay.global_router_replay_instances if id(handle) not in owned
        ]
        self._armed: RecordedRouting | None = None
        self._agreement: list[torch.Tensor | None] = [None] * shape.num_layers
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._agreement_hook(index))

    @property
    def can_replay(self) -> bool:
        return len(self.replays) == len(self.routers)

    def run(
        self, forward: Callable[[], torch.Tensor], routing: RecordedRouting | None, *, replay: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward() with `routing` replayed (when `replay`), and the per-layer agreement (None without
        routing). Replay state is cleared whatever happens."""
        if routing is None:
            return forward(), None
        with self._armed_with(routing, replay=replay):
            output = forward()
            agreement = torch.stack([a if a is not None else torch.tensor(float("nan")) for a in self._agreement])
        return output, agreement

    @contextlib.contextmanager
    def _armed_with(self, routing: RecordedRouting, *, replay: bool) -> Iterator[None]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction  # type: ignore[import-untyped]

        if replay and not self.can_replay:
            raise RuntimeError("this model was built without moe_enable_routing_replay")
        self._armed = routing
        self._agreement = [None] * self.shape.num_layers
        try:
            if replay:
                for handle, ids in zip(self.replays, routing.expert_ids, strict=True):
                    handle.set_target_indices(ids.to(self.routers[0].weight.device))
                    handle.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            yield
        finally:
            self._armed = None
            for handle in self.replays:
                handle.clear_indices()
                handle.clear_router_replay_action()

    def _agreement_hook(self, index: int) -> Callable[[Any, tuple[Any, ...], Any], None]:
        def hook(router: Any, args: tuple[Any, ...], output: Any) -> None:
            routing = self._armed
            if routing is None:
                return
            with torch.no_grad():
                own_map = self._own_routing_map(router, args[0]) if self._replaying(router) else output[1]
                recorded_ids = routing.expert_ids[index].to(own_map.device)
                recorded_map = torch.zeros_like(own_map).scatter(1, recorded_ids, True)
                same = (own_map == recorded_map).all(dim=-1)[routing.recorded.to(own_map.device)]
                self._agreement[index] = same.float().mean().cpu() if same.numel() else torch.tensor(1.0)

        return hook

    @staticmethod
    def _replaying(router: Any) -> bool:
        return router.router_replay is not None and router.router_replay.router_replay_action is not None

    @staticmethod
    def _own_routing_map(router: Any, hidden: torch.Tensor) -> torch.Tensor:
        """What the router would route to without replay: megatron's own routing function, replay off."""
        from megatron.core.transformer.moe.moe_utils import (  # type: ignore[import-untyped]
            topk_routing_with_score_function,
        )

        config = router.config
        logits = router.gating(hidden).reshape(-1, config.num_moe_experts)
        _, routing_map = topk_routing_with_score_function(
            logits,
            router.topk,
            use_pre_softmax=config.moe_router_pre_softmax,
            num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor,
            score_function=router.score_function,
            expert_bias=router.expert_bias,
        )
        result: torch.Tensor = routing_map
        return result
