"""The evaluation section of a job spec: held-out prompts scored on the job's own engines at given weight versions.

With `evaluation` set, one rollout worker of the job (the controller marks it) runs, at every weight version `v`
with `v % every_n_versions == 0` (version 0, the initial weights, is the baseline), `n_samples_per_prompt`
episodes per prompt of each dataset with the job's agent and reward, every request pinned to version `v` (the
session's `min_weight_version`; an episode with a turn served at another version is discarded and counted, never
scored as `v`). Evaluation shares the job's engines with rollout: it runs at most `capacity_share` of the
worker's episode slots at once (`miles.rollout.eval_loop`). Results per version go to Redis
(`miles.common.contracts.evals`) and are served by the controller (`GET /v1/jobs/{id}/evals`, `miles status`).

Limits: a version the engines have already left when the worker notices it (the trainer published two versions
within one rollout episode) cannot be pinned any more and is recorded as missed; the dataset is read in file
order, `limit` rows at most; an episode that fails scores 0.
"""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles.common.jobspec.rollout import DatasetSpec

EVAL_DATASET_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,39}$"
"""A dataset's name: a short identifier (it is a metric label value and a key part)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class EvalDatasetSpec(_Section):
    """One held-out dataset, scored with the job's agent (or environment) and reward."""

    name: str = Field(pattern=EVAL_DATASET_NAME_PATTERN)
    """Name shown in results, events and the `dataset` label of `miles_rollout_eval_reward`."""

    dataset: DatasetSpec
    """The prompts (same format as `rollout.dataset`; `shuffle` is ignored: file order)."""

    limit: int | None = Field(default=None, ge=1, le=100_000)
    """Evaluate only the first `limit` prompts (default: every prompt, or `dataset.limit`)."""


class EvaluationSpec(_Section):
    """Asynchronous evaluation per weight version on the job's engines (mode (a) of the eval-and-recipes issue)."""

    datasets: list[EvalDatasetSpec] = Field(min_length=1, max_length=8)
    """Datasets to score at each evaluated version (names unique)."""

    every_n_versions: int = Field(default=5, ge=1)
    """Evaluate the versions that are multiples of this (0 included: the baseline)."""

    n_samples_per_prompt: int = Field(default=1, ge=1, le=64)
    """Episodes per prompt; pass@k needs k <= this."""

    greedy: bool = True
    """Greedy decoding (temperature 0); false: the rollout's `request_kwargs` (sampled)."""

    pass_at_k: list[int] = Field(default_factory=lambda: [1], min_length=1, max_length=8)
    """The k of the pass@k reported (unbiased estimator over the `n_samples_per_prompt` episodes; a sample
    passes when its reward >= `pass_threshold`)."""

    pass_threshold: float = 1.0
    """Reward at or above which an episode counts as a pass for pass@k."""

    capacity_share: float = Field(default=0.25, gt=0, le=1)
    """Most episodes evaluation runs at once, as a share of the worker's `max_live_episodes` (at least 1)."""

    @field_validator("datasets")
    @classmethod
    def _unique_names(cls, datasets: list[EvalDatasetSpec]) -> list[EvalDatasetSpec]:
        names = [d.name for d in datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"evaluation dataset names must be unique (got {names})")
        return datasets

    @model_validator(mode="after")
    def _k_within_samples(self) -> Self:
        too_big = [k for k in self.pass_at_k if k < 1 or k > self.n_samples_per_prompt]
        if too_big:
            raise ValueError(
                f"pass_at_k {too_big} must be within 1..n_samples_per_prompt ({self.n_samples_per_prompt})"
            )
        return self

    def due(self, version: int) -> bool:
        """Whether `version` is one to evaluate."""
        return version >= 0 and version % self.every_n_versions == 0
