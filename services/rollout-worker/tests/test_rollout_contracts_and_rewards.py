"""User-code contracts (loading agents and reward functions, reading what an agent returns) and the built-in
verifiers."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles.common.jobspec.rollout import (
    AgentRewardSpec,
    ExactMatchRewardSpec,
    FunctionRewardSpec,
    NumericRewardSpec,
    RegexRewardSpec,
)
from miles.proto.common.v1 import common_pb2
from miles.rollout.contracts import load_callable, parse_agent_result
from miles.rollout.errors import UserCodeLoadError
from miles.rollout.rewards import (
    EpisodeToScore,
    Scorer,
    exact_match,
    numeric_match,
    parse_number,
    regex_match,
    solution_code,
)

USER_MODULE = """
async def agent(base_url, prompt, request_kwargs, metadata):
    return {"reward": 1.0}

def sync_agent(base_url, prompt, request_kwargs, metadata):
    return None

async def reward(prompt, samples, agent_result):
    return [float(len(samples)), agent_result["bonus"]]

async def bad_reward(prompt, samples, agent_result):
    return "high"
"""


@pytest.fixture
def user_dir(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "user_code_for_rollout_tests.py").write_text(USER_MODULE)
    yield tmp_path
    sys.modules.pop("user_code_for_rollout_tests", None)


def test_agents_load_by_dotted_path_and_must_be_async(user_dir: Path) -> None:
    agent = load_callable("user_code_for_rollout_tests:agent", [str(user_dir)], what="agent")
    assert asyncio.run(agent("u", {}, {}, {})) == {"reward": 1.0}
    with pytest.raises(UserCodeLoadError, match="async def"):
        load_callable("user_code_for_rollout_tests:sync_agent", [str(user_dir)], what="agent")
    with pytest.raises(UserCodeLoadError, match="has no 'missing'"):
        load_callable("user_code_for_rollout_tests:missing", [str(user_dir)], what="agent")
    with pytest.raises(UserCodeLoadError, match="cannot import"):
        load_callable("no_such_module_anywhere:agent", [], what="agent")


def test_agent_results_are_checked() -> None:
    result = parse_agent_result({"reward": 1, "turn_rewards": [0, 0.5], "metadata": {"k": 1}, "answer": "4", "x": 2})
    assert result.reward == 1.0 and result.turn_rewards == [0.0, 0.5] and result.raw["x"] == 2
    assert parse_agent_result(None).reward is None
    for bad in ([1], {"reward": float("nan")}, {"reward": "1"}, {"metadata": []}, {"answer": 3}, {"turn_rewards": 1}):
        with pytest.raises(ValueError):
            parse_agent_result(bad)


@pytest.mark.parametrize(
    ("text", "number"),
    [("Answer: 42", 42.0), ("so -3.5 then 7", 7.0), ("1,234 apples", 1234.0), (r"\boxed{3/4} not 9", 0.75),
     ("no digits", None), ("x = .5", 0.5)],
)  # fmt: skip
def test_numbers_are_read_from_answers(text: str, number: float | None) -> None:
    assert parse_number(text) == number


def test_verifiers() -> None:
    assert exact_match("  Paris ", "paris") == 1.0 and exact_match("Paris", "paris", case_sensitive=True) == 0.0
    assert exact_match(None, "x") == 0.0
    assert numeric_match("it is 72.0000001", "72") == 1.0 and numeric_match("it is 71", 72) == 0.0
    assert numeric_match("nothing", "1") == 0.0
    assert regex_match("Final: B", "B", pattern=r"Final: (\w)") == 1.0
    assert regex_match("Final: C", "B", pattern=r"Final: (\w)") == 0.0
    assert regex_match("DONE", None, pattern="DONE") == 1.0 and regex_match("x", None, pattern="DONE") == 0.0
    assert solution_code("text\n```python\nprint(1)\n```\nmore") == "print(1)\n"
    assert solution_code("print(2)") == "print(2)"


def episode(samples: int = 1, answer: str | None = None, final: str | None = None, **raw: Any) -> EpisodeToScore:
    async def final_text() -> str | None:
        return final

    result = parse_agent_result({**raw, **({"answer": answer} if answer is not None else {})})
    return EpisodeToScore(
        prompt={"messages": []},
        label="12",
        samples=[common_pb2.Sample() for _ in range(samples)],
        agent_result=result,
        final_message_text=final_text,
    )


def score(spec: Any, ep: EpisodeToScore) -> tuple[list[float], dict[str, Any]]:
    return asyncio.run(Scorer(spec, job_id="j", sandbox=None).score(ep))


def test_scorer_uses_the_agent_reward_or_a_verifier(user_dir: Path) -> None:
    assert score(AgentRewardSpec(), episode(2, reward=0.5)) == ([0.5, 0.5], {})
    assert score(AgentRewardSpec(), episode(1)) == ([0.0], {"reward_missing": True})
    assert score(NumericRewardSpec(type="numeric"), episode(answer="= 12"))[0] == [1.0]
    assert score(NumericRewardSpec(type="numeric"), episode(final="I think 12."))[0] == [1.0], "last assistant text"
    assert score(ExactMatchRewardSpec(type="exact_match"), episode(answer="13"))[0] == [0.0]
    assert score(RegexRewardSpec(type="regex", pattern=r"=(\d+)"), episode(answer="x=12"))[0] == [1.0]
    function = FunctionRewardSpec(
        type="function", function="user_code_for_rollout_tests:reward", python_path=[str(user_dir)]
    )
    assert score(function, episode(2, bonus=0.25))[0] == [2.0, 0.25]
    with pytest.raises(ValueError, match="2 rewards for 3 samples"):
        score(function, episode(3, bonus=0.25))
    bad = FunctionRewardSpec(type="function", function="user_code_for_rollout_tests:bad_reward")
    with pytest.raises(ValueError, match="float or a list"):
        score(bad, episode(1))
