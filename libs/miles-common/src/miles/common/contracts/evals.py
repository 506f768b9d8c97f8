"""Evaluation results per weight version: the Redis key the rollout worker writes and the controller reads.

One hash per job, `miles:evals:<job_id>`: field = the weight version (decimal), value = the JSON of a
`VersionEval` (`to_json`). A field is written once, after every dataset of that version was scored (or the
version was found missed), so a present field means "done": a restarted worker does not evaluate it again, and a
reader never sees half a version. The key lives as long as the job's other rollout keys (the controller deletes it
with the job's data, or Redis keeps it).

Also here: the unbiased pass@k estimator (Chen et al. 2021), shared by the worker and tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

EVALS_KEY_PREFIX = "miles:evals"


def evals_key(job_id: str) -> str:
    """The hash of a job's evaluation results (field: version)."""
    return f"{EVALS_KEY_PREFIX}:{job_id}"


def eval_claim_key(job_id: str, version: int) -> str:
    """The claim of one version's evaluation (SET NX with a TTL): of a job's workers, the one that sets it
    evaluates the version, the others leave it."""
    return f"{EVALS_KEY_PREFIX}:{job_id}:claim:{version}"


@dataclass(frozen=True)
class DatasetEval:
    """One dataset's score at one version. `num_discarded` episodes had a turn served at another version and are
    in no number here except that count; failed episodes score 0 and are counted by `reasons`."""

    mean_reward: float
    pass_at_k: dict[str, float]
    num_prompts: int
    num_episodes: int
    num_discarded: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class VersionEval:
    """Every dataset of one version. `lag_s`: from when the evaluating worker first saw the version served (a
    finished rollout episode at it) to `scored_unix_ms`; it leaves out the time from the trainer's publish to that
    sighting (at most one rollout episode plus the weight update). `status` "missed": the engines had left the
    version before it could be evaluated (no dataset scored)."""

    version: int
    status: Literal["scored", "missed"]
    scored_unix_ms: int
    seen_unix_ms: int
    lag_s: float
    datasets: dict[str, DatasetEval] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> VersionEval:
        data: dict[str, Any] = json.loads(text)
        datasets = {name: DatasetEval(**value) for name, value in (data.get("datasets") or {}).items()}
        return cls(
            version=int(data["version"]),
            status=data["status"],
            scored_unix_ms=int(data["scored_unix_ms"]),
            seen_unix_ms=int(data["seen_unix_ms"]),
            lag_s=float(data["lag_s"]),
            datasets=datasets,
        )


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from `num_samples` (of which
    `num_correct` pass) passes: 1 - C(n-c, k) / C(n, k). Needs 1 <= k <= num_samples."""
    if not 1 <= k <= num_samples or not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= c <= n (n={num_samples}, c={num_correct})")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def parse_evals(raw: dict[Any, Any]) -> list[VersionEval]:
    """The results of an HGETALL, oldest version first; unreadable fields are skipped (never a 500)."""
    results = []
    for value in raw.values():
        try:
            results.append(VersionEval.from_json(value))
        except (ValueError, KeyError, TypeError):
            continue
    return sorted(results, key=lambda r: r.version)
