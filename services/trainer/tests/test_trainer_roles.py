"""Multi-agent episodes: samples of several roles in one group. Advantages are computed per (group, role), a batch
without roles exactly as before roles existed, and the step metrics and /metrics carry per-role figures."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
from prometheus_client import generate_latest

from miles.common.jobspec.trainer import AdvantageEstimator, TrainConfig
from miles.common.telemetry import Metrics
from miles.proto.common.v1 import common_pb2
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.advantages import SampleReward, compute_advantages, roles_have_signal
from miles.trainer.assemble import assemble
from miles.trainer.batch import BadGroupError, TrainSample, samples_from_group
from miles.trainer.metrics import TrainerMetrics
from miles.trainer.roles import MAX_ROLE_LABELS, parse_role_key, role_key

ESTIMATORS: tuple[AdvantageEstimator, ...] = ("grpo", "dr_grpo", "reinforce_pp_baseline")


def _legacy_advantages(samples: Sequence[SampleReward], estimator: str, eps: float) -> list[float]:
    """The estimators as they were before roles (commit ab87d2f), kept verbatim as the reference."""
    by_group: dict[int, list[float]] = {}
    for sample in samples:
        if sample.trainable:
            by_group.setdefault(sample.group_index, []).append(sample.reward)
    stats: dict[int, tuple[float, float]] = {}
    for group_index, rewards in by_group.items():
        mean = rewards[0] if len(set(rewards)) == 1 else sum(rewards) / len(rewards)
        num = len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (num - 1)) if num > 1 else 0.0
        stats[group_index] = (mean, std)
    advantages = []
    for sample in samples:
        if not sample.trainable:
            advantages.append(0.0)
            continue
        mean, std = stats[sample.group_index]
        centered = sample.reward - mean
        advantages.append(centered / (std + eps) if estimator == "grpo" else centered)
    if estimator != "reinforce_pp_baseline":
        return advantages
    weights = [s.num_loss_tokens if s.trainable else 0 for s in samples]
    total = sum(weights)
    if total == 0:
        return [0.0] * len(advantages)
    mean = sum(a * w for a, w in zip(advantages, weights, strict=True)) / total
    var = sum(w * (a - mean) ** 2 for a, w in zip(advantages, weights, strict=True)) / total
    std = math.sqrt(var)
    return [((a - mean) / (std + eps)) if w else 0.0 for a, w in zip(advantages, weights, strict=True)]


def _random_batch(rng: random.Random, role: str | None = None) -> list[SampleReward]:
    """Groups of 1-6 samples, rewards of mixed scales, some untrainable, some groups of equal rewards."""
    samples = []
    for group_index in range(rng.randrange(1, 6)):
        equal = rng.random() < 0.2
        for _ in range(rng.randrange(1, 7)):
            reward = 1.0 if equal else rng.choice([0.0, 1.0, rng.uniform(-3, 7), 0.1 * rng.randrange(10)])
            trainable = rng.random() < 0.85
            samples.append(SampleReward(group_index, reward, trainable, rng.randrange(1, 9) if trainable else 0, role))
    return samples


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_samples_without_roles_get_bit_identical_advantages(estimator: AdvantageEstimator) -> None:
    rng = random.Random(11)
    for _ in range(200):
        samples = _random_batch(rng)
        assert compute_advantages(samples, estimator, eps=1e-6) == _legacy_advantages(samples, estimator, 1e-6)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_batch_of_one_role_is_computed_as_a_batch_without_roles(estimator: AdvantageEstimator) -> None:
    rng = random.Random(5)
    for _ in range(50):
        samples = _random_batch(rng, role="solver")
        unnamed = [SampleReward(s.group_index, s.reward, s.trainable, s.num_loss_tokens) for s in samples]
        assert compute_advantages(samples, estimator) == compute_advantages(unnamed, estimator)


def _two_roles() -> list[SampleReward]:
    """One group, interleaved: solver rewards in [0, 1], verifier rewards on a scale 100 times larger."""
    solver, verifier = [1.0, 0.0, 0.0, 1.0], [300.0, 100.0, 200.0, 200.0]
    samples = []
    for s_reward, v_reward in zip(solver, verifier, strict=True):
        samples += [SampleReward(0, s_reward, True, 2, "solver"), SampleReward(0, v_reward, True, 2, "verifier")]
    return samples


def test_grpo_normalises_each_role_of_a_group_on_its_own() -> None:
    samples = _two_roles()
    advantages = compute_advantages(samples, "grpo", eps=1e-6)
    for role, rewards in (("solver", [1.0, 0.0, 0.0, 1.0]), ("verifier", [300.0, 100.0, 200.0, 200.0])):
        alone = compute_advantages([SampleReward(0, r, True, 2) for r in rewards], "grpo", eps=1e-6)
        assert [a for a, s in zip(advantages, samples, strict=True) if s.role == role] == alone
    solver = [a for a, s in zip(advantages, samples, strict=True) if s.role == "solver"]
    std = math.sqrt(4 * 0.25 / 3)
    assert solver == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    # one shared baseline would have given every solver sample a large negative advantage
    assert max(compute_advantages([SampleReward(0, s.reward, True, 2) for s in samples], "grpo")[::2]) < -0.5


def test_dr_grpo_subtracts_each_roles_own_mean() -> None:
    advantages = compute_advantages(_two_roles(), "dr_grpo")
    assert advantages == [0.5, 100.0, -0.5, -100.0, -0.5, 0.0, 0.5, 0.0]


def test_reinforce_pp_baseline_whitens_each_role_over_the_batch_on_its_own() -> None:
    samples = [*_two_roles(), SampleReward(1, 0.0, True, 3, "solver"), SampleReward(1, 4.0, True, 1, "solver")]
    advantages = compute_advantages(samples, "reinforce_pp_baseline", eps=1e-6)
    for role in ("solver", "verifier"):
        indices = [i for i, s in enumerate(samples) if s.role == role]
        mine = [advantages[i] for i in indices]
        weights = [samples[i].num_loss_tokens for i in indices]
        mean = sum(a * w for a, w in zip(mine, weights, strict=True)) / sum(weights)
        var = sum(w * (a - mean) ** 2 for a, w in zip(mine, weights, strict=True)) / sum(weights)
        assert mean == pytest.approx(0.0, abs=1e-9)
        assert math.sqrt(var) == pytest.approx(1.0, rel=1e-4)


def test_a_group_has_signal_only_when_rewards_differ_within_a_role() -> None:
    assert not roles_have_signal([("solver", 1.0), ("verifier", 0.0), ("solver", 1.0), ("verifier", 0.0)])
    assert roles_have_signal([("solver", 1.0), ("verifier", 0.0), ("solver", 0.0), ("verifier", 0.0)])
    assert roles_have_signal([(None, 1.0), (None, 0.0)])
    assert not roles_have_signal([(None, 1.0)])


def _group(roles: Sequence[str | None], rewards: Sequence[float]) -> common_pb2.Group:
    group = common_pb2.Group(group_id="g")
    for index, (role, reward) in enumerate(zip(roles, rewards, strict=True)):
        sample = group.samples.add(
            sample_id=f"g/{index}",
            tokens=[1, 2, 3, 4],
            response_start=2,
            loss_mask=[1, 1],
            rollout_logprobs=[-1.0, -1.0],
            reward=reward,
            status=common_pb2.SAMPLE_STATUS_COMPLETED,
        )
        if role is not None:
            sample.metadata.update({"role": role, "turn": 3})
    return group


def test_the_role_is_read_from_sample_metadata() -> None:
    samples = samples_from_group(_group(["solver", "verifier", None], [1, 0, 0]), 0, vocab_size=8, max_positions=8)
    assert [s.role for s in samples] == ["solver", "verifier", None]


@pytest.mark.parametrize("role", [7, "", True])
def test_a_role_that_is_not_a_non_empty_string_is_refused(role: float | str | bool) -> None:
    group = _group([None], [1.0])
    group.samples[0].metadata.update({"role": role})
    with pytest.raises(BadGroupError) as caught:
        samples_from_group(group, 0, vocab_size=8, max_positions=8)
    assert caught.value.reason == "bad_role"


def _train_samples(roles: Sequence[str | None], rewards: Sequence[float]) -> list[TrainSample]:
    return samples_from_group(_group(roles, rewards), 0, vocab_size=8, max_positions=8)


def test_step_statistics_carry_reward_and_samples_per_role() -> None:
    samples = _train_samples(["solver", "verifier", "solver", "verifier", "verifier"], [1, 10, 0, 30, 20])
    samples[4].trainable = False
    stats = assemble([samples], [0], TrainConfig(), trainer_version=0, world_size=1).stats
    assert stats[role_key("reward_mean", "solver")] == 0.5
    assert stats[role_key("reward_std", "solver")] == 0.5
    assert stats[role_key("num_samples", "solver")] == 2.0
    assert stats[role_key("reward_mean", "verifier")] == 20.0
    assert stats[role_key("num_samples", "verifier")] == 3.0
    assert stats[role_key("num_trainable_samples", "verifier")] == 2.0
    assert [s.advantage for s in samples[:4]] == pytest.approx([0.7071, -10 / 14.1421, -0.7071, 10 / 14.1421], 1e-3)
    assert stats["reward_mean"] == 10.25  # the batch-wide figures stay over every trainable sample


def test_step_statistics_without_roles_have_no_per_role_keys() -> None:
    stats = assemble([_train_samples([None, None], [1, 0])], [0], TrainConfig(), trainer_version=0, world_size=1)
    assert not [name for name in stats.stats if parse_role_key(name) is not None]
    assert stats.stats["num_samples"] == 2.0


def test_per_role_keys_survive_the_trainers_status_message() -> None:
    """What the controller reads (backends: `Status.last_step_metrics` as they are) keeps the names unchanged."""
    values = {role_key("reward_mean", "solver"): 0.25, "reward_mean": 0.5}
    wire = trainer_pb2.StatusResponse(last_step_metrics=values).SerializeToString()
    assert dict(trainer_pb2.StatusResponse.FromString(wire).last_step_metrics) == values


def test_role_gauges_are_exported_with_a_bounded_role_label() -> None:
    metrics = Metrics("trainer")
    trainer_metrics = TrainerMetrics(metrics)
    values = {role_key("reward_mean", f"r{i}"): float(i) for i in range(MAX_ROLE_LABELS + 2)}
    values |= {role_key("num_samples", "r0"): 4.0, role_key("num_samples", "r1"): 2.0}
    trainer_metrics.observe_skipped_step(values)
    text = generate_latest(metrics.registry).decode()
    assert 'miles_trainer_role_reward_mean{role="r3"} 3.0' in text
    assert 'miles_trainer_role_num_samples{role="r0"} 4.0' in text
    assert f'role="r{MAX_ROLE_LABELS - 1}"' in text
    assert f'role="r{MAX_ROLE_LABELS}"' not in text  # over the bound: in the step metrics, not exported
    trainer_metrics.observe_skipped_step({role_key("num_samples", "r0"): 3.0})
    text = generate_latest(metrics.registry).decode()
    assert 'miles_trainer_role_num_samples{role="r0"} 3.0' in text
    assert 'miles_trainer_role_num_samples{role="r1"} 0.0' in text  # absent from the step: no samples
