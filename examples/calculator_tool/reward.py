"""Partial-credit reward of the calculator task (friendly to a tiny model learning the tool format).

1.0 for the right `Answer: <number>`; otherwise 0.25 for at least one valid calculator call plus 0.25 when a
tool result equals the label (it computed the right thing but did not report it). Malformed or no calls: 0.
"""

from __future__ import annotations

import math
import re
from typing import Any

ANSWER_RE = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


async def reward(prompt: dict[str, Any], samples: list[Any], agent_result: dict[str, Any]) -> float:
    label = float(prompt["label"])
    match = ANSWER_RE.search(agent_result.get("answer") or "")
    if match is not None and math.isclose(float(match.group(1)), label):
        return 1.0
    score = 0.0
    if agent_result.get("num_valid_tool_calls", 0) > 0:
        score += 0.25
    if any(
        (value := _number(result)) is not None and math.isclose(value, label)
        for result in agent_result.get("tool_results", [])
    ):
        score += 0.25
    return score
