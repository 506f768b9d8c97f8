"""Rollout Routing Replay (R3) in the torch backend, on the tiny Qwen3-MoE model (4 MoE layers, 8 experts, top-2)
in deterministic mode, with rollouts the real engine generated concurrently (in-process, routed experts on):

- re-scored with R3, the trainer's logprobs equal the engine's bit for bit (also through a whole trainer step with
  strict_on_policy, split into several micro-batches);
- after the router moved (a perturbation of its weights, as an async weight update does), the trainer without R3
  drifts (logprob diff > 0, routing agreement < 1); with R3 every forward (policy, reference model, pi_old scoring
  pass) computes with exactly the recorded experts, and the drift is smaller;
- when only the routing moved (a top-1 MoE with renormalised weights, whose combine weight is exactly 1: the router
  decides which expert, nothing else), the drift without R3 is > 0 and with R3 exactly 0;
- the step statistics report the logprob diff and the agreement with R3 on and off, and the metrics export them;
- the router still gets a gradient under replay (the recorded experts' probabilities are differentiable).

Figures printed with `-s`: logprob diffs and agreements with and without R3.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.common.contracts.routing import RoutingShape, routing_shape_from_hf_config
from miles.common.errors import ConfigError
from miles.common.jobspec.trainer import TrainConfig
from miles.common.telemetry import Metrics
from miles.model import CausalLM
from miles.model.moe import SparseMoeBlock
from miles.proto.common.v1 import common_pb2
from miles.trainer.assemble import assemble
from miles.trainer.backends.base import resolve_routing_replay
from miles.trainer.backends.torch_backend import TorchBackend, load_policy
from miles.trainer.backends.torch_routing import sample_routing
from miles.trainer.batch import TrainSample, samples_from_group
from miles.trainer.metrics import TrainerMetrics
from miles.trainer.step import run_step

Rollouts = list[tuple[list[int], list[dict[str, Any]]]]
VOCAB, MAX_POSITIONS = 151936, 32768
TINY_MOE_ROUTING = RoutingShape(num_layers=4, top_k=2, num_experts=8)


@dataclass(frozen=True)
class MoeData:
    """Engine rollouts (prompt, replies) and the conftest's `moe_group` that turns them into buffer groups."""

    rollouts: Rollouts
    make_group: Callable[..., common_pb2.Group]


@pytest.fixture(scope="module")
def rollouts(tiny_moe_model_dir: Path, moe_rollouts: Any, make_moe_group: Any) -> MoeData:
    """4 prompts x 2 samples, generated concurrently by one deterministic engine."""
    generated = moe_rollouts(tiny_moe_model_dir, num_prompts=4, samples_per_prompt=2, seed=1)
    return MoeData(generated, make_moe_group)


def _samples(data: MoeData) -> list[list[TrainSample]]:
    """Each prompt's group through the trainer's validation (routing unpacked, replay on)."""
    return [
        samples_from_group(
            data.make_group(f"g{index}", prompt, replies),
            index,
            vocab_size=VOCAB,
            max_positions=MAX_POSITIONS,
            routing=TINY_MOE_ROUTING,
            routing_replay=True,
        )
        for index, (prompt, replies) in enumerate(data.rollouts)
    ]


def _flat(groups: list[list[TrainSample]]) -> list[TrainSample]:
    return [sample for group in groups for sample in group]


def _rollout_logprobs(samples: list[TrainSample]) -> torch.Tensor:
    return torch.tensor([lp for sample in samples for lp in sample.rollout_logprobs])


def _backend(model_dir: Path, *, replay: bool, **train: Any) -> TorchBackend:
    return load_policy(model_dir, TrainConfig(deterministic=True, routing_replay=replay, **train))


@torch.no_grad()
def _perturb_router(lm: CausalLM, sigma: float, seed: int = 0) -> None:
    """Add N(0, sigma) to every router (gate) weight: top-k choices near a tie flip, as after a weight update."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in lm.named_parameters():
        if name.endswith("mlp.gate.weight"):
            parameter.add_(sigma * torch.randn(parameter.shape, generator=generator))


@pytest.fixture
def experts_used(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The expert ids every MoE block computed with, one entry per call (per forward: one per MoE layer)."""
    used: list[torch.Tensor] = []
    original = SparseMoeBlock.add_output

    def spy(
        block: SparseMoeBlock, x: torch.Tensor, h: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, **kw: Any
    ) -> torch.Tensor:
        used.append(ids.detach().cpu().clone())
        return original(block, x, h, probs, ids, **kw)

    monkeypatch.setattr(SparseMoeBlock, "add_output", spy)
    return used


def _recorded(samples: list[TrainSample]) -> torch.Tensor:
    """The recorded routing of a packed forward of `samples` (each fed without its last token)."""
    return torch.cat([sample_routing(sample, TINY_MOE_ROUTING) for sample in samples])


def test_replay_is_resolved_at_start_from_the_model(tiny_moe_model_dir: Path, small_model_dir: Path) -> None:
    assert resolve_routing_replay(TrainConfig(), TINY_MOE_ROUTING) is True
    assert resolve_routing_replay(TrainConfig(routing_replay=False), TINY_MOE_ROUTING) is False
    assert resolve_routing_replay(TrainConfig(), None) is False
    assert resolve_routing_replay(TrainConfig(routing_replay=False), None) is False
    with pytest.raises(ConfigError, match="no MoE layers") as refused:
        resolve_routing_replay(TrainConfig(routing_replay=True), None)
    assert refused.value.field == "train.routing_replay"

    moe = load_policy(tiny_moe_model_dir, TrainConfig())
    hf_config = json.loads((tiny_moe_model_dir / "config.json").read_text())
    assert moe.shape.routing == TINY_MOE_ROUTING == routing_shape_from_hf_config(hf_config)
    assert moe.routing_replay is True
    assert load_policy(tiny_moe_model_dir, TrainConfig(routing_replay=False)).routing_replay is False
    dense = load_policy(small_model_dir, TrainConfig())
    assert (dense.shape.routing, dense.routing_replay) == (None, False)
    with pytest.raises(ConfigError, match="routing_replay is true but the model has no MoE layers"):
        load_policy(small_model_dir, TrainConfig(routing_replay=True))


def test_engine_rollouts_rescored_with_replay_equal_the_engines_logprobs_exactly(
    tiny_moe_model_dir: Path, rollouts: MoeData
) -> None:
    groups = _samples(rollouts)
    samples = _flat(groups)
    assert all(len(s.routed_experts or ()) == (s.num_tokens - 1) * 8 for s in samples)
    backend = _backend(tiny_moe_model_dir, replay=True)
    together = backend.forward(samples, temperature=1.0, entropy_grad=False)
    assert torch.equal(together.logprobs, _rollout_logprobs(samples))
    assert together.routing_agreement is not None
    assert together.routing_agreement.tolist() == [1.0] * 4
    alone = torch.cat([backend.forward([s], temperature=1.0, entropy_grad=False).logprobs for s in samples])
    assert torch.equal(alone, together.logprobs)

    config = TrainConfig(deterministic=True, strict_on_policy=True, micro_batch_max_tokens=40, ppo_epochs=2)
    assembled = assemble(groups, [0] * len(groups), config, trainer_version=0, world_size=1)
    assert assembled.plan.num_micro_batches > 1
    result = run_step(backend, assembled.plan, config)  # strict: fails unless every recomputed logprob is exact
    assert result.violation is None and result.num_optimizer_steps == 2
    stats = result.stats
    assert stats["train_rollout_logprob_abs_diff_max"] == stats["train_rollout_logprob_abs_diff"] == 0.0
    assert stats["routing_agreement"] == 1.0
    assert [stats[f"routing_agreement_layer_{layer}"] for layer in range(4)] == [1.0] * 4
    print("R3 rescoring of engine rollouts:", {k: v for k, v in stats.items() if "diff" in k or "agreement" in k})


def test_after_the_router_moved_only_replay_computes_with_the_recorded_experts(
    tiny_moe_model_dir: Path, rollouts: MoeData, experts_used: list[torch.Tensor]
) -> None:
    samples = _flat(_samples(rollouts))
    rollout = _rollout_logprobs(samples)
    recorded = _recorded(samples)
    outcome: dict[bool, tuple[float, list[float]]] = {}
    for replay in (False, True):
        backend = _backend(tiny_moe_model_dir, replay=replay)
        before = backend.forward(samples, temperature=1.0, entropy_grad=False).logprobs
        assert torch.equal(before, rollout)  # the engine's weights: no drift, with or without R3
        _perturb_router(backend.policy.lm, sigma=0.01)
        experts_used.clear()
        after = backend.forward(samples, temperature=1.0, entropy_grad=False)
        assert after.routing_agreement is not None
        outcome[replay] = (float((after.logprobs.detach() - rollout).abs().mean()), after.routing_agreement.tolist())
        used = torch.stack(experts_used, dim=1)  # (rows, layers, top_k): what each MoE block computed with
        same = (used.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1).float().mean(dim=0)
        if replay:
            assert torch.equal(used, recorded)  # exactly the engine's experts, in its order
        else:
            assert same.tolist() == after.routing_agreement.tolist()  # without R3 it uses its own picks
    (diff_off, agreement_off), (diff_on, agreement_on) = outcome[False], outcome[True]
    print(f"router perturbed (sigma 0.01): without R3 diff {diff_off:.4f} agreement {agreement_off}")
    print(f"                               with R3    diff {diff_on:.4f} agreement {agreement_on}")
    assert diff_off > 0.0 and min(agreement_off) < 1.0
    assert 0.0 < diff_on < diff_off
    assert min(agreement_on) < 1.0  # the router would pick otherwise: reported, though replay overrides it


def test_reference_model_and_pi_old_scoring_replay_the_recorded_experts(
    tiny_moe_model_dir: Path, rollouts: MoeData, experts_used: list[torch.Tensor]
) -> None:
    groups = _samples(rollouts)
    samples = _flat(groups)
    recorded = _recorded(samples)
    config = TrainConfig(deterministic=True, routing_replay=True, ppo_epochs=2, loss={"kl_coef": 0.1})
    backend = load_policy(tiny_moe_model_dir, config)
    assert backend.reference is not None
    _perturb_router(backend.policy.lm, sigma=0.01, seed=1)
    _perturb_router(backend.reference, sigma=0.01, seed=2)
    experts_used.clear()
    backend.reference_logprobs(samples, temperature=1.0)
    assert torch.equal(torch.stack(experts_used, dim=1), recorded)

    experts_used.clear()
    assembled = assemble(groups, [0] * len(groups), config, trainer_version=0, world_size=1)
    assert assembled.plan.num_micro_batches == 1
    result = run_step(backend, assembled.plan, config)
    assert result.num_optimizer_steps == 2
    # pi_old scoring pass + reference (first epoch) + two policy forwards, every one with the recorded experts
    calls = [torch.stack(experts_used[start : start + 4], dim=1) for start in range(0, len(experts_used), 4)]
    assert len(calls) == 4
    assert all(torch.equal(used, recorded) for used in calls)


def test_step_statistics_report_the_logprob_diff_and_agreement_with_and_without_replay(
    tiny_moe_model_dir: Path, rollouts: MoeData
) -> None:
    """Step 1 trains on fresh data (diff 0, agreement 1); step 2 on the same data one version old, as async mode
    would: the first optimizer step moved the router, so the trainer's routing no longer agrees everywhere."""
    for replay in (True, False):
        config = TrainConfig(deterministic=True, routing_replay=replay, optimizer={"lr": 1e-4})
        backend = load_policy(tiny_moe_model_dir, config)
        steps = []
        for version in (0, 1):
            groups = copy.deepcopy(_samples(rollouts))
            assembled = assemble(groups, [version] * len(groups), config, trainer_version=version, world_size=1)
            steps.append(run_step(backend, assembled.plan, config).stats)
        fresh, stale = steps
        assert fresh["train_rollout_logprob_abs_diff_max"] == 0.0 and fresh["routing_agreement"] == 1.0
        assert stale["train_rollout_logprob_abs_diff"] > 0.0
        assert stale["routing_agreement"] < 1.0
        layers = [stale[f"routing_agreement_layer_{layer}"] for layer in range(4)]
        assert stale["routing_agreement"] == pytest.approx(sum(layers) / 4)
        print(
            f"R3 {'on ' if replay else 'off'}: stale step diff {stale['train_rollout_logprob_abs_diff']:.4f} "
            f"(max {stale['train_rollout_logprob_abs_diff_max']:.4f}), agreement per layer {layers}"
        )

        metrics = Metrics("trainer")
        values = {**stale, "routing_replay": float(replay), "wait_data_s": 0.0, "forward_backward_s": 1.0}
        TrainerMetrics(metrics).observe_step(values | {"optimizer_s": 0.0}, [1], num_samples=8, num_tokens=100)
        text = metrics.exposition().decode()
        for layer, value in enumerate(layers):
            assert f'miles_trainer_routing_agreement_ratio{{layer="{layer}"}} {value!r}' in text
        assert f"miles_trainer_routing_replay {float(replay)!r}" in text
        diff = stale["train_rollout_logprob_abs_diff"]
        assert f"miles_trainer_train_rollout_logprob_abs_diff {diff!r}" in text


def test_the_router_gets_a_gradient_under_replay(tiny_moe_model_dir: Path, rollouts: MoeData) -> None:
    samples = _flat(_samples(rollouts))
    gradients: dict[bool, dict[str, torch.Tensor]] = {}
    for replay in (True, False):
        backend = _backend(tiny_moe_model_dir, replay=replay)
        backend.zero_grad()
        backend.forward(samples, temperature=1.0, entropy_grad=False).logprobs.sum().backward()  # type: ignore[no-untyped-call]
        gradients[replay] = {
            name: p.grad.clone()
            for name, p in backend.named_parameters()
            if name.endswith("mlp.gate.weight") and p.grad is not None
        }
    replayed = gradients[True]
    assert len(replayed) == 4
    assert all(bool(torch.isfinite(g).all()) and float(g.abs().sum()) > 0.0 for g in replayed.values())
    # Replaying the router's own picks computes what free routing computes, gradients included.
    for name, gradient in replayed.items():
        torch.testing.assert_close(gradient, gradients[False][name], rtol=1e-5, atol=1e-7)

    backend = _backend(tiny_moe_model_dir, replay=True)
    _perturb_router(backend.policy.lm, sigma=0.03)
    backend.zero_grad()
    backend.forward(samples, temperature=1.0, entropy_grad=False).logprobs.sum().backward()  # type: ignore[no-untyped-call]
    moved = [p.grad for name, p in backend.named_parameters() if name.endswith("mlp.gate.weight")]
    assert all(g is not None and float(g.abs().sum()) > 0.0 for g in moved)


TOP1_ROUTING = RoutingShape(num_layers=4, top_k=1, num_experts=8)


@pytest.fixture(scope="module")
def top1_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny MoE with top-1 routing and norm_topk_prob: each token's combine weight is p / p = 1 exactly, so the
    router's weights change which expert computes, and nothing else."""
    from miles.engine.tiny_model import build_tiny_model

    overrides = {"num_experts_per_tok": 1, "norm_topk_prob": True}
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-moe-top1", moe=True, config_overrides=overrides)


def test_when_only_the_routing_moved_replay_leaves_no_drift_at_all(
    top1_model_dir: Path, moe_rollouts: Any, make_moe_group: Any
) -> None:
    generated = moe_rollouts(top1_model_dir, num_prompts=4, samples_per_prompt=2, seed=3)
    samples = [
        sample
        for index, (prompt, replies) in enumerate(generated)
        for sample in samples_from_group(
            make_moe_group(f"t{index}", prompt, replies, routing=TOP1_ROUTING),
            index,
            vocab_size=VOCAB,
            max_positions=MAX_POSITIONS,
            routing=TOP1_ROUTING,
            routing_replay=True,
        )
    ]
    rollout = _rollout_logprobs(samples)
    diffs: dict[bool, float] = {}
    for replay in (False, True):
        backend = _backend(top1_model_dir, replay=replay)
        assert torch.equal(backend.forward(samples, temperature=1.0, entropy_grad=False).logprobs, rollout)
        _perturb_router(backend.policy.lm, sigma=0.05)  # an update of the router alone, as async training makes
        after = backend.forward(samples, temperature=1.0, entropy_grad=False)
        assert after.routing_agreement is not None and min(after.routing_agreement.tolist()) < 1.0
        diffs[replay] = float((after.logprobs.detach() - rollout).abs().max())
    print(f"top-1 MoE, router moved: max |logprob diff| without R3 {diffs[False]:.4f}, with R3 {diffs[True]}")
    assert diffs[False] > 0.0 and diffs[True] == 0.0
