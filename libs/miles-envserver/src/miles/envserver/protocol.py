"""The wire contract between a rollout worker and an environment server (version v1), JSON over HTTP/1.1.

    GET  /healthz                 -> {"status": "ok"}  (200 once `setup` finished; 503 before)
    GET  /v1/info                 -> {"protocol": "v1", "connector": str, "environment": str, "num_rows": int}
    GET  /v1/rows?offset=&limit=  -> {"rows": [Row...], "total": int}
    POST /v1/episodes  EpisodeRequest -> EpisodeResult

Errors answer {"error": {"code": str, "message": str}} with 400 (a bad request), 404 (no such route or row),
500 (the environment raised: `environment_error`), 503 (not set up yet). A Row is what the worker's dataset
holds: `prompt` (a string or OpenAI messages), `label` (anything JSON), `info` (a dict the environment needs
back at episode time). An episode is one run of the environment's protocol against the session's OpenAI
endpoint (`base_url`, `api_key`): every model call goes through it, so the session records it token for token.

Standard library only: this module is imported by the servers (their own interpreters) and by the worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = "v1"


class ProtocolError(ValueError):
    """A message outside the contract; the text names the field."""


def _dict(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{name} must be an object")
    return value


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProtocolError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Row:
    prompt: str | list[dict[str, Any]]
    label: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "label": self.label, "info": self.info}

    @classmethod
    def from_json(cls, value: Any) -> Row:
        body = _dict(value, "row")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt)
        ):
            raise ProtocolError("row.prompt must be a string or a non-empty list of messages with a role")
        return cls(prompt=prompt, label=body.get("label"), info=_dict(body.get("info"), "row.info"))


@dataclass(frozen=True)
class EpisodeRequest:
    base_url: str
    """The session's OpenAI base URL (`.../v1`): chat completions go to `{base_url}/chat/completions`."""
    api_key: str
    row_index: int
    row: Row
    request_kwargs: dict[str, Any] = field(default_factory=dict)
    """Sampling parameters in OpenAI names (temperature, max_tokens, ...): pass them on every model call."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """episode_id, group_id, sample_index, sandbox_url (when the job has one), ..."""

    def to_json(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "api_key": self.api_key,
            "row_index": self.row_index,
            "row": self.row.to_json(),
            "request_kwargs": self.request_kwargs,
            "metadata": self.metadata,
        }

    @classmethod
    def from_json(cls, value: Any) -> EpisodeRequest:
        body = _dict(value, "episode request")
        base_url, api_key, row_index = body.get("base_url"), body.get("api_key"), body.get("row_index")
        if not isinstance(base_url, str) or not base_url:
            raise ProtocolError("base_url must be a non-empty string")
        if not isinstance(api_key, str):
            raise ProtocolError("api_key must be a string")
        if isinstance(row_index, bool) or not isinstance(row_index, int) or row_index < 0:
            raise ProtocolError("row_index must be an integer >= 0")
        return cls(
            base_url=base_url,
            api_key=api_key,
            row_index=row_index,
            row=Row.from_json(body.get("row")),
            request_kwargs=_dict(body.get("request_kwargs"), "request_kwargs"),
            metadata=_dict(body.get("metadata"), "metadata"),
        )


@dataclass(frozen=True)
class EpisodeResult:
    reward: float
    """The environment's own score of the episode (its rubric, scorer or verifier)."""
    reward_info: dict[str, Any] = field(default_factory=dict)
    """Per-criterion scores and the like, kept in the samples' metadata."""
    metadata: dict[str, Any] = field(default_factory=dict)
    turn_rewards: list[float] | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"reward": self.reward, "reward_info": self.reward_info, "metadata": self.metadata}
        if self.turn_rewards is not None:
            body["turn_rewards"] = self.turn_rewards
        return body

    @classmethod
    def from_json(cls, value: Any) -> EpisodeResult:
        """Raises ProtocolError on a malformed result (the worker aborts the episode with `bad_reward`)."""
        body = _dict(value, "episode result")
        turn_rewards = body.get("turn_rewards")
        if turn_rewards is not None:
            if not isinstance(turn_rewards, list):
                raise ProtocolError("turn_rewards must be a list of numbers")
            turn_rewards = [_finite(r, "turn_rewards[i]") for r in turn_rewards]
        return cls(
            reward=_finite(body.get("reward"), "reward"),
            reward_info=_dict(body.get("reward_info"), "reward_info"),
            metadata=_dict(body.get("metadata"), "metadata"),
            turn_rewards=turn_rewards,
        )
