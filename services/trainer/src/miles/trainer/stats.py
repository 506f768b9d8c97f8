"""Step statistics accumulated over micro-batches and ranks: totals, means (sum + count), minima, maxima.

Every per-token statistic of an optimizer step (clip fraction, TIS weights, logprob differences ...) is added
here per micro-batch as a sum and a count, so its value is the exact mean over the minibatch whatever the
micro-batch split and the number of ranks. `merge` combines accumulators (e.g. gathered from other ranks);
`mean_over_updates` turns the optimizer steps of one trainer step into its statistics (mean over them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class StepStats:
    """Named means, minima and maxima of one step."""

    totals: dict[str, float] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    minima: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)

    def add_total(self, name: str, value: float) -> None:
        """Adds `value` to the sum `name` (reported as the sum, e.g. a loss already divided by global counts)."""
        self.totals[name] = self.totals.get(name, 0.0) + float(value)

    def add_mean(self, name: str, total: float, count: float) -> None:
        """Adds `total` over `count` items to the running mean `name`."""
        self.sums[name] = self.sums.get(name, 0.0) + float(total)
        self.counts[name] = self.counts.get(name, 0.0) + float(count)

    def add_masked(self, name: str, values: torch.Tensor, mask: torch.Tensor, *, extremes: bool = False) -> None:
        """Mean (and optionally min/max) of `values` where `mask` is nonzero."""
        selected = values.detach()[mask.detach() > 0].double()
        self.add_mean(name, float(selected.sum()), selected.numel())
        if extremes and selected.numel():
            self.add_min(f"{name}_min", float(selected.min()))
            self.add_max(f"{name}_max", float(selected.max()))

    def add_min(self, name: str, value: float) -> None:
        self.minima[name] = min(self.minima.get(name, math.inf), float(value))

    def add_max(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, -math.inf), float(value))

    def merge(self, other: StepStats) -> None:
        for name, value in other.totals.items():
            self.add_total(name, value)
        for name, total in other.sums.items():
            self.add_mean(name, total, other.counts[name])
        for name, value in other.minima.items():
            self.add_min(name, value)
        for name, value in other.maxima.items():
            self.add_max(name, value)

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {
            "totals": self.totals,
            "sums": self.sums,
            "counts": self.counts,
            "minima": self.minima,
            "maxima": self.maxima,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Mapping[str, float]]) -> StepStats:
        return cls(
            totals=dict(raw["totals"]),
            sums=dict(raw["sums"]),
            counts=dict(raw["counts"]),
            minima=dict(raw["minima"]),
            maxima=dict(raw["maxima"]),
        )

    def result(self) -> dict[str, float]:
        """Totals, means (0 when nothing was counted), minima and maxima by name."""
        out = dict(self.totals)
        out |= {name: (total / self.counts[name] if self.counts[name] else 0.0) for name, total in self.sums.items()}
        out.update({name: value for name, value in self.minima.items() if math.isfinite(value)})
        out.update({name: value for name, value in self.maxima.items() if math.isfinite(value)})
        return out


def merge_all(parts: Iterable[StepStats]) -> StepStats:
    merged = StepStats()
    for part in parts:
        merged.merge(part)
    return merged


def mean_over_updates(parts: Sequence[StepStats]) -> dict[str, float]:
    """A trainer step's statistics from those of its optimizer steps: each total (a loss already divided by its
    minibatch's counts) and each mean averaged over the optimizer steps that counted it, minima and maxima over
    all of them. With one part this is exactly `parts[0].result()`."""
    out: dict[str, float] = {}
    for name in dict.fromkeys(name for part in parts for name in part.totals):
        totals = [part.totals[name] for part in parts if name in part.totals]
        out[name] = sum(totals) / len(totals)
    for name in dict.fromkeys(name for part in parts for name in part.sums):
        means = [part.sums[name] / part.counts[name] for part in parts if part.counts.get(name, 0.0)]
        out[name] = sum(means) / len(means) if means else 0.0
    extremes = merge_all(parts)
    out.update({name: value for name, value in extremes.minima.items() if math.isfinite(value)})
    out.update({name: value for name, value in extremes.maxima.items() if math.isfinite(value)})
    return out
