"""Scoring an episode after it ended: the agent's own reward, a built-in verifier, or a user reward function.

Built-in verifiers compare the episode's *answer* (the agent's returned `answer`, else the content of the last
assistant message of the session) with the row's label:
- `exact_match`: equal after trimming and collapsing whitespace (and case-folding unless case_sensitive);
- `numeric`: the number in the answer's last `\\boxed{...}`, else its last number, equals the label's number
  within tolerance (`1,234` and `-0.5` and `3/4` are numbers);
- `regex`: the pattern's first group equals the label (or, without a group, the pattern matches);
- `unit_tests`: the answer is written as a file into a fresh sandbox with the row's tests, the test command runs,
  exit code 0 scores 1.0 (or the PASS fraction with partial_credit). The sandbox is always destroyed.
Every verifier scores 0.0 when there is no answer. Rewards are one float per sample of the episode.

Multi-agent episodes (`rollout.roles`): the samples of every role are scored together. A reward function may
return `{role: reward}` (each sample gets its `metadata.role`'s reward; a missing or unknown role is a
`BadRewardError`), a float (every role gets it) or a list (one per sample, every role's in order); the agent's
reward and the verifiers give every role the same reward, the verifiers' default answer being the first role's
last assistant message.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from miles.common.errors import ConfigError
from miles.common.jobspec.rollout import (
    ExactMatchRewardSpec,
    FunctionRewardSpec,
    NumericRewardSpec,
    RegexRewardSpec,
    RewardSpec,
    UnitTestsRewardSpec,
)
from miles.proto.common.v1 import common_pb2
from miles.rollout import samples as sample_ops
from miles.rollout.contracts import AgentResult, RewardFn, load_callable
from miles.rollout.errors import BadRewardError
from miles.rollout.sandbox import SandboxClient

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")
_FENCED_RE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def _normalize(text: str, case_sensitive: bool) -> str:
    collapsed = " ".join(text.split())
    return collapsed if case_sensitive else collapsed.casefold()


def exact_match(answer: str | None, label: Any, *, case_sensitive: bool = False) -> float:
    if answer is None or label is None:
        return 0.0
    return float(_normalize(answer, case_sensitive) == _normalize(str(label), case_sensitive))


def parse_number(text: str) -> float | None:
    """The number in the last \\boxed{}, else the last number in text; None when there is none."""
    boxed = _BOXED_RE.findall(text)
    candidates = _NUMBER_RE.findall(boxed[-1] if boxed else text)
    if not candidates:
        return None
    token = candidates[-1].replace(",", "").replace(" ", "")
    try:
        return float(Fraction(token)) if "/" in token else float(token)
    except (ValueError, ZeroDivisionError):
        return None


def numeric_match(answer: str | None, label: Any, *, abs_tolerance: float = 1e-6, rel_tolerance: float = 1e-6) -> float:
    if answer is None or label is None:
        return 0.0
    expected = float(label) if isinstance(label, int | float) else parse_number(str(label))
    got = parse_number(answer)
    if expected is None or got is None:
        return 0.0
    return float(math.isclose(got, expected, rel_tol=rel_tolerance, abs_tol=abs_tolerance))


def regex_match(answer: str | None, label: Any, *, pattern: str) -> float:
    if answer is None:
        return 0.0
    match = re.search(pattern, answer)
    if match is None:
        return 0.0
    if match.re.groups == 0:
        return 1.0
    return float(label is not None and (match.group(1) or "").strip() == str(label).strip())


def solution_code(answer: str) -> str:
    """The code of an answer: its last ```python fenced block, else the whole answer."""
    blocks = _FENCED_RE.findall(answer)
    return blocks[-1] if blocks else answer


async def unit_tests_score(
    sandbox: SandboxClient, job_id: str, answer: str | None, tests: Any, spec: UnitTestsRewardSpec
) -> tuple[float, dict[str, Any]]:
    """(score, info) of running the row's tests against the answer in a fresh sandbox."""
    if answer is None or not isinstance(tests, str):
        return 0.0, {"unit_tests": "no answer" if answer is None else f"row field {spec.tests_key!r} is not text"}
    sandbox_id = await sandbox.create(job_id, template=spec.template, ttl_s=spec.timeout_s + 120.0)
    try:
        await sandbox.write_file(sandbox_id, spec.solution_file, solution_code(answer).encode())
        await sandbox.write_file(sandbox_id, spec.tests_file, tests.encode())
        result = await sandbox.run(sandbox_id, spec.command, timeout_s=spec.timeout_s)
    finally:
        await sandbox.destroy(sandbox_id)
    info: dict[str, Any] = {"exit_code": result.exit_code, "timed_out": result.timed_out}
    if spec.partial_credit:
        lines = [line.strip() for line in result.stdout.splitlines()]
        num_pass = sum(1 for line in lines if line.startswith("PASS"))
        num_fail = sum(1 for line in lines if line.startswith("FAIL"))
        info.update(num_pass=num_pass, num_fail=num_fail)
        return (num_pass / (num_pass + num_fail) if num_pass + num_fail else 0.0), info
    return float(result.exit_code == 0 and not result.timed_out), info


@dataclass(frozen=True)
class EpisodeToScore:
    """What scoring sees of one finished episode."""

    prompt: dict[str, Any]
    label: Any
    samples: list[common_pb2.Sample]
    agent_result: AgentResult
    final_message_text: Callable[[], Awaitable[str | None]]
    """The content of the session's last assistant message (fetched only when a verifier needs it)."""
    roles: tuple[str, ...] = ()
    """The job's declared roles (`rollout.roles`); each sample of a multi-agent episode has one in metadata.role."""


class Scorer:
    """The job's reward, built once: `await scorer.score(episode)` -> (one reward per sample, reward_info)."""

    def __init__(self, spec: RewardSpec, *, job_id: str, sandbox: SandboxClient | None) -> None:
        self.spec = spec
        self.job_id = job_id
        self.sandbox = sandbox
        self._function: RewardFn | None = None
        if isinstance(spec, FunctionRewardSpec):
            self._function = load_callable(spec.function, spec.python_path, what="rollout.reward.function")
        if isinstance(spec, UnitTestsRewardSpec) and sandbox is None:
            raise ConfigError("reward type unit_tests needs sandbox_address", field="sandbox_address")

    async def _answer(self, episode: EpisodeToScore) -> str | None:
        if episode.agent_result.answer is not None:
            return episode.agent_result.answer
        return await episode.final_message_text()

    async def score(self, episode: EpisodeToScore) -> tuple[list[float], dict[str, Any]]:
        spec, num_samples = self.spec, len(episode.samples)
        if self._function is not None:
            value = await self._function(episode.prompt, list(episode.samples), dict(episode.agent_result.raw))
            return _per_sample(value, episode.samples, episode.roles), {}
        if spec.type == "agent":
            if episode.agent_result.reward is None:
                return [0.0] * num_samples, {"reward_missing": True}
            return [episode.agent_result.reward] * num_samples, {}
        answer = await self._answer(episode)
        info: dict[str, Any] = {}
        if isinstance(spec, ExactMatchRewardSpec):
            value_f = exact_match(answer, episode.label, case_sensitive=spec.case_sensitive)
        elif isinstance(spec, NumericRewardSpec):
            value_f = numeric_match(
                answer, episode.label, abs_tolerance=spec.abs_tolerance, rel_tolerance=spec.rel_tolerance
            )
        elif isinstance(spec, RegexRewardSpec):
            value_f = regex_match(answer, episode.label, pattern=spec.pattern)
        else:
            assert isinstance(spec, UnitTestsRewardSpec) and self.sandbox is not None
            tests = episode.prompt.get(spec.tests_key)
            value_f, info = await unit_tests_score(self.sandbox, self.job_id, answer, tests, spec)
        return [value_f] * num_samples, info


def _per_role(
    value: Mapping[object, object], samples: Sequence[common_pb2.Sample], roles: Sequence[str]
) -> list[float]:
    """Each sample gets its role's reward; the mapping must name exactly the job's roles."""
    if not roles:
        raise BadRewardError("the reward function returned rewards per role, but the job declares no rollout.roles")
    unknown = sorted(str(role) for role in value if role not in roles)
    missing = [role for role in roles if role not in value]
    if unknown or missing:
        raise BadRewardError(
            f"the reward function's rewards per role must name exactly the job's roles {list(roles)}: "
            f"unknown {unknown}, missing {missing}"
        )
    by_role: dict[str, float] = {}
    for role, reward in value.items():
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise BadRewardError(f"the reward of role {role!r} must be a number, not {type(reward).__name__}")
        by_role[str(role)] = float(reward)
    sample_roles = [sample_ops.role_of(sample) for sample in samples]
    if any(role not in by_role for role in sample_roles):  # the worker labels every sample: a broken invariant
        raise BadRewardError(f"samples of roles {sample_roles} do not all have a role of {list(roles)}")
    return [by_role[role] for role in sample_roles]


def _per_sample(value: object, samples: Sequence[common_pb2.Sample], roles: Sequence[str]) -> list[float]:
    num_samples = len(samples)
    if isinstance(value, Mapping):
        rewards = _per_role(value, samples, roles)
    elif isinstance(value, list):
        if len(value) != num_samples:
            raise ValueError(f"the reward function returned {len(value)} rewards for {num_samples} samples")
        rewards = [float(item) for item in value]
    elif isinstance(value, int | float) and not isinstance(value, bool):
        rewards = [float(value)] * num_samples
    else:
        raise ValueError(
            "the reward function must return a float or a list of floats (or {role: float} with rollout.roles), "
            f"not {type(value).__name__}"
        )
    if not all(math.isfinite(reward) for reward in rewards):
        raise ValueError(f"the reward function returned a non-finite reward: {rewards}")
    return rewards
