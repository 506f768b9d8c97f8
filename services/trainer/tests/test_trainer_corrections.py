"""TIS and MIS weights, masks and statistics, pinned against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from miles.common.jobspec.trainer import CorrectionConfig
from miles.trainer.corrections import compute_correction
from miles.trainer.stats import StepStats

# Two sequences of 2 tokens; train/rollout probability ratios 0.5, 4.0 | 1.0, 0.00001.
RATIOS = [0.5, 4.0, 1.0, 1e-5]
TRAIN = torch.log(torch.tensor(RATIOS, dtype=torch.float32))
ROLLOUT = torch.zeros(4)
MASK = torch.ones(4)
SEQ_IDS = torch.tensor([0, 0, 1, 1])


def correct(**config: object) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    stats = StepStats()
    result = compute_correction(TRAIN, ROLLOUT, MASK, SEQ_IDS, 2, CorrectionConfig(**config), stats)  # type: ignore[arg-type]
    return result.weights, result.keep, stats.result()


def test_tis_clamps_ratios_to_the_miles_default_range_and_reports_stats() -> None:
    weights, keep, stats = correct(mode="tis")
    assert weights.tolist() == pytest.approx([0.5, 2.0, 1.0, 1e-5], rel=1e-4)
    assert keep.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert stats["is_clamped_fraction"] == pytest.approx(0.25)
    assert stats["is_ratio_max"] == pytest.approx(4.0, rel=1e-5)
    assert stats["is_ratio_min"] == pytest.approx(1e-5, rel=1e-3)
    assert stats["is_ratio"] == pytest.approx(sum(RATIOS) / 4, rel=1e-5)
    assert stats["is_weight_max"] == pytest.approx(2.0)


def test_tis_lower_bound() -> None:
    weights, _, stats = correct(mode="tis", tis_lower=0.8, tis_upper=1.5)
    assert weights.tolist() == pytest.approx([0.8, 1.5, 1.0, 0.8])
    assert stats["is_clamped_fraction"] == pytest.approx(0.75)


def test_none_mode_weights_one_but_still_reports_the_mismatch() -> None:
    weights, _, stats = correct(mode="none")
    assert weights.tolist() == [1.0] * 4
    assert stats["is_ratio_max"] == pytest.approx(4.0, rel=1e-5)


def test_mis_token_truncate_caps_only_above() -> None:
    weights, keep, _ = correct(mode="mis", mis_level="token", mis_mode="truncate", mis_upper=2.0)
    assert weights.tolist() == pytest.approx([0.5, 2.0, 1.0, 1e-5], rel=1e-4)
    assert keep.tolist() == [1.0] * 4


def test_mis_token_mask_drops_tokens_outside_bounds_with_default_lower() -> None:
    weights, keep, stats = correct(mode="mis", mis_level="token", mis_mode="mask", mis_upper=2.0)
    # lower defaults to 1 / upper = 0.5: 0.5 kept (inclusive), 4.0 dropped, 1.0 kept, 1e-5 dropped
    assert keep.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert weights.tolist() == pytest.approx(RATIOS, rel=1e-4)
    assert stats["is_masked_fraction"] == pytest.approx(0.5)


def test_mis_sequence_level_uses_the_product_of_ratios() -> None:
    weights, _, _ = correct(mode="mis", mis_level="sequence", mis_mode="clip", mis_upper=10.0, mis_lower=0.0)
    # seq 0: 0.5 * 4 = 2 ; seq 1: 1 * 1e-5 = 1e-5
    assert weights.tolist() == pytest.approx([2.0, 2.0, 1e-5, 1e-5], rel=1e-4)


def test_mis_geometric_level_uses_the_geometric_mean() -> None:
    weights, _, _ = correct(mode="mis", mis_level="geometric", mis_mode="truncate", mis_upper=10.0)
    seq1 = math.sqrt(1e-5)
    assert weights.tolist() == pytest.approx([math.sqrt(2.0), math.sqrt(2.0), seq1, seq1], rel=1e-4)


def test_rejection_sampling_and_veto() -> None:
    _, keep, stats = correct(
        mode="mis",
        mis_mode="truncate",
        mis_upper=2.0,
        rs_enabled=True,
        rs_level="token",
        rs_lower=0.4,
        rs_upper=3.0,
        rs_veto_threshold=1e-4,
    )
    # rs drops 4.0 (above 3) and 1e-5 (below 0.4); the veto drops all of seq 1 (it has a token below 1e-4)
    assert keep.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert stats["is_veto_seq_fraction"] == pytest.approx(0.5)
    assert stats["is_masked_fraction"] == pytest.approx(0.75)


def test_masked_tokens_do_not_enter_statistics_or_sequence_ratios() -> None:
    stats = StepStats()
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    config = CorrectionConfig(mode="mis", mis_level="sequence", mis_mode="clip", mis_upper=10.0, mis_lower=0.0)
    result = compute_correction(TRAIN, ROLLOUT, mask, SEQ_IDS, 2, config, stats)
    assert result.weights[0].item() == pytest.approx(0.5, rel=1e-4)  # seq 0 ratio without the masked 4.0
    assert stats.result()["is_ratio_max"] == pytest.approx(1.0)


def test_log_ratio_is_clamped_before_exp() -> None:
    stats = StepStats()
    result = compute_correction(
        torch.tensor([100.0]),
        torch.tensor([0.0]),
        torch.ones(1),
        torch.zeros(1, dtype=torch.long),
        1,
        CorrectionConfig(mode="mis", mis_mode="clip", mis_upper=1e12),
        stats,
    )
    assert result.weights.item() == pytest.approx(math.exp(20.0), rel=1e-5)
