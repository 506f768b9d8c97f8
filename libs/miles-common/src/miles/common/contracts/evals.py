"""Evaluation results per weight version: the Redis key the rollout worker writes and the controller reads.

One hash per job, `miles:evals:<job_id>`: field = the weight version (decimal), value = the JSON of a
`VersionEval` (`to_json`). A field is written after every dataset of that version was scored (or the version was
found missed), so a present field means "done": a restarted worker does not evaluate it again, and a reader never
sees half a version. Writers: the evaluating rollout worker (`evaluator` "engines": mode (a), the job's own
engines at that version) and the controller's `POST /v1/jobs/{id}/evals` for an evaluator outside the job
(`miles eval --job-id`: a checkpoint on an engine of its own, or any external scorer). A score is written once,
by whoever scores the version first (`store_scored`): it replaces a `missed` (e.g. a checkpoint evaluator scoring
a version the engines had left), never another score; a `missed` is written only where nothing is. The
controller deletes the hash with the job.

Also here: the unbiased pass@k estimator (Chen et al. 2021), shared by the worker and tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis

EVALS_KEY_PREFIX = "miles:evals"
ENGINES_EVALUATOR = "engines"
"""`VersionEval.evaluator` of a version scored on the job's own engines by its rollout worker (mode (a))."""
EVALUATOR_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,39}$"
"""What an external evaluator may call itself (a short identifier: shown in results and events)."""


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
    sighting (at most one rollout episode plus the weight update); for an external evaluator, from the
    `seen_unix_ms` it reported (when it got the version). `status` "missed": the engines had left the version
    before it could be evaluated (no dataset scored). `evaluator`: `ENGINES_EVALUATOR`, or the name an external
    evaluator gave."""

    version: int
    status: Literal["scored", "missed"]
    scored_unix_ms: int
    seen_unix_ms: int
    lag_s: float
    datasets: dict[str, DatasetEval] = field(default_factory=dict)
    evaluator: str = ENGINES_EVALUATOR

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
            evaluator=str(data.get("evaluator") or ENGINES_EVALUATOR),
        )


STORE_SCORED_LUA = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current then
  local ok, parsed = pcall(cjson.decode, current)
  if ok and type(parsed) == 'table' and parsed['status'] ~= 'missed' then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
"""KEYS[1] the evals hash, ARGV[1] the version, ARGV[2] the JSON: set unless the version has a score (atomic)."""


async def store_scored(redis: aioredis.Redis, job_id: str, result: VersionEval) -> bool:
    """Write `result` (a score) unless its version already has one; a `missed` or unreadable entry is replaced.
    False: an earlier score stands."""
    field = str(result.version)
    return bool(await redis.eval(STORE_SCORED_LUA, 1, evals_key(job_id), field, result.to_json()))  # type: ignore[misc]


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
