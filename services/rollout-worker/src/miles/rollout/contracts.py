"""The two contracts user code implements, and how the worker loads and reads them.

Agent (`rollout.agent.function`, a dotted path `module:function`):

    async def agent(base_url: str, prompt: dict, request_kwargs: dict, metadata: dict) -> dict | None

- `base_url`: an OpenAI base URL of the episode's own session (`<session-server>/v1/sessions/<id>/v1`); use it
  with any OpenAI client and `api_key=metadata["api_key"]`. Every call is recorded token for token.
- `prompt`: the dataset row, plus `messages` (the row's prompt as OpenAI messages).
- `request_kwargs`: the job's sampling parameters in OpenAI names (`temperature`, `max_tokens`, ...).
- `metadata`: `api_key`, `job_id`, `group_id`, `episode_id`, `sample_index`, `prompt_index`, `epoch`,
  `attempt`, `label`, `max_seq_len`, `agent_config`, `sandbox_url` / `sandbox_address` (when configured), and
  with `rollout.roles` `roles`: `{role: {"base_url", "api_key", "session_id"}}`, one session per role (`base_url`
  and `api_key` are then the first role's).
- returns (all keys optional): `reward` (float), `reward_info` (dict), `turn_rewards` (one float per model call,
  put on the last token of that call's span in `token_rewards`), `metadata` (dict merged into every sample's
  metadata), `answer` (str: the final answer for the built-in verifiers; default: the last assistant message).
  Any other key is kept for the reward function. None means {}.

Reward (`rollout.reward` with `type: function`):

    async def reward(prompt: dict, samples: list[miles.common.v1.Sample], agent_result: dict)
        -> float | list[float] | dict[str, float]

called once per episode after its samples are assembled (only when one is trainable); a list gives one reward
per sample (per-turn mode), a float the same reward to all, `{role: reward}` each role's samples their role's
reward (`rollout.roles`: the samples of every role, each with `metadata["role"]`). Neither contract imports
anything of miles.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.proto.common.v1 import common_pb2
from miles.rollout.errors import UserCodeLoadError

AgentFn = Callable[[str, dict[str, Any], dict[str, Any], dict[str, Any]], Awaitable[dict[str, Any] | None]]
RewardFn = Callable[
    [dict[str, Any], list[common_pb2.Sample], dict[str, Any]], Awaitable[float | list[float] | dict[str, float]]
]


def _is_async_callable(value: object) -> bool:
    return inspect.iscoroutinefunction(value) or inspect.iscoroutinefunction(getattr(value, "__call__", None))  # noqa: B004


def load_callable(dotted_path: str, python_path: Sequence[str] = (), *, what: str) -> Callable[..., Any]:
    """Imports `module:function` (after putting python_path in front of sys.path); it must be async."""
    for directory in reversed(python_path):
        resolved = str(Path(directory).resolve())
        if resolved not in sys.path:
            sys.path.insert(0, resolved)
    module_name, _, attribute = dotted_path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # user code may fail to import in any way; say which and why
        raise UserCodeLoadError(
            f"cannot import {what} module {module_name!r}: {type(exc).__name__}: {exc}", field=what
        ) from exc
    function = getattr(module, attribute, None)
    if function is None:
        raise UserCodeLoadError(f"{what} {dotted_path!r}: module {module_name!r} has no {attribute!r}", field=what)
    if not _is_async_callable(function):
        raise UserCodeLoadError(f"{what} {dotted_path!r} must be an `async def` function", field=what)
    return function  # type: ignore[no-any-return]


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class AgentResult:
    """What an agent returned, checked (see the module docstring for the keys)."""

    raw: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    reward_info: dict[str, Any] = field(default_factory=dict)
    turn_rewards: list[float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    answer: str | None = None


def parse_agent_result(value: object) -> AgentResult:
    """Raises ValueError naming the bad key when the agent returned something outside the contract."""
    if value is None:
        return AgentResult()
    if not isinstance(value, dict):
        raise ValueError(f"the agent must return a dict or None, not {type(value).__name__}")
    reward = value.get("reward")
    reward_info = value.get("reward_info")
    reward_info = {} if reward_info is None else reward_info
    turn_rewards = value.get("turn_rewards")
    metadata = value.get("metadata")
    metadata = {} if metadata is None else metadata
    answer = value.get("answer")
    if not isinstance(reward_info, dict):
        raise ValueError("reward_info must be a dict")
    if not isinstance(metadata, dict):
        raise ValueError("metadata must be a dict")
    if answer is not None and not isinstance(answer, str):
        raise ValueError("answer must be a string")
    if turn_rewards is not None:
        if not isinstance(turn_rewards, list):
            raise ValueError("turn_rewards must be a list of numbers")
        turn_rewards = [_finite(item, "turn_rewards[i]") for item in turn_rewards]
    return AgentResult(
        raw=value,
        reward=None if reward is None else _finite(reward, "reward"),
        reward_info=reward_info,
        turn_rewards=turn_rewards,
        metadata=metadata,
        answer=answer,
    )
