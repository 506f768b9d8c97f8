"""Per-role reward of the solver-verifier task: `{"solver": ..., "verifier": ...}` (the job declares both roles).

- solver: 1.0 when its answer (the number of its last `Answer: <number>` line, else the last number it wrote)
  equals the label; a wrong number 0.1, no number 0.0;
- verifier: 1.0 when its `Verdict: correct` / `Verdict: incorrect` matches whether the solver was right; a wrong
  verdict 0.1, none 0.0.

The 0.1 for a wrong but well-formed reply is there for small models (as in calculator_tool): a policy that is
never right still gets a gradient towards answering at all, and the trainer skips groups whose rewards are all
equal within each role.

The rollout worker gives each role's samples their role's reward, and the trainer normalises advantages per
(group, role): a verifier's reward scale never shifts the solver's baseline.
"""

from __future__ import annotations

import math
import re
from typing import Any

ANSWER_RE = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")
NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
VERDICT_RE = re.compile(r"Verdict:\s*(correct|incorrect)\b", re.IGNORECASE)


def parse_answer(text: str) -> float | None:
    """The number of the last `Answer: <number>` line, else the last number of the text, else None."""
    found = ANSWER_RE.findall(text) or NUMBER_RE.findall(text)
    return float(found[-1]) if found else None


def parse_verdict(text: str) -> bool | None:
    """True for the last `Verdict: correct`, False for `Verdict: incorrect`, None without a verdict."""
    found = VERDICT_RE.findall(text)
    return found[-1].lower() == "correct" if found else None


FORMAT_CREDIT = 0.1
"""Reward of a well-formed but wrong answer or verdict line."""


def _score(given: bool, right: bool) -> float:
    return 1.0 if right else FORMAT_CREDIT if given else 0.0


async def reward(prompt: dict[str, Any], samples: list[Any], agent_result: dict[str, Any]) -> dict[str, float]:
    answer = parse_answer(agent_result.get("answer") or "")
    solver_right = answer is not None and math.isclose(answer, float(prompt["label"]))
    verdict = parse_verdict(agent_result.get("verdict_text") or "")
    verifier_right = verdict is not None and verdict == solver_right
    return {"solver": _score(answer is not None, solver_right), "verifier": _score(verdict is not None, verifier_right)}
