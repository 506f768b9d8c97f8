"""Reads the router makes from engines besides forwarding: health, generation check, weight version, capacity.

Health: GET `health_check_path` (200 = healthy). Generation check: GET `serving_check_path` (SGLang
/health_generate: it generates one token, so it fails — 503, or no answer within the timeout — while generation is
paused or a weight load holds the engine; 200 = it serves, 404/405 = the engine has no such route). Weight
version: `/model_info`, then `/get_model_info` (SGLang before v0.5.6), then `/server_info` (its ServerArgs carry
`weight_version`); the first path that answers is remembered per engine. Capacity: `/server_info` (or
`/get_server_info`) `max_running_requests` and `max_total_num_tokens` (also looked up in `internal_states[0]`,
where SGLang puts scheduler values).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from miles.common.contracts.weight_version import parse_weight_version
from miles.router.clients import EngineClients

_VERSION_PATHS = ("/model_info", "/get_model_info", "/server_info", "/get_server_info")
_SERVER_INFO_PATHS = ("/server_info", "/get_server_info")


@dataclass(frozen=True)
class EngineCapacity:
    max_running_requests: int | None
    max_total_num_tokens: int | None


class EngineProber:
    def __init__(self, clients: EngineClients, health_path: str, timeout_s: float, serving_path: str = "") -> None:
        self.clients = clients
        self.health_path = health_path
        self.serving_path = serving_path
        self.timeout_s = timeout_s
        self._version_path: dict[str, str] = {}

    async def health(self, url: str) -> bool:
        try:
            response = await self.clients.get(url).get(url + self.health_path, timeout=self.timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def serving(self, url: str) -> bool | None:
        """Whether the engine generates now (False: paused, busy loading, or no answer within the timeout); None
        when the check is off or the engine has no such route (404/405)."""
        if not self.serving_path:
            return None
        try:
            response = await self.clients.get(url).get(url + self.serving_path, timeout=self.timeout_s)
        except httpx.HTTPError:
            return False
        if response.status_code in (404, 405):
            return None
        return response.status_code == 200

    async def weight_version(self, url: str) -> tuple[bool, int | None]:
        """(answered, version): answered is False when no path gave a weight_version field."""
        known = self._version_path.get(url)
        for path in (known,) if known else _VERSION_PATHS:
            info = await self._get_json(url, path)
            if info is not None and "weight_version" in info:
                self._version_path[url] = path
                return True, parse_weight_version(info["weight_version"])
        self._version_path.pop(url, None)
        return False, None

    async def capacity(self, url: str) -> EngineCapacity:
        for path in _SERVER_INFO_PATHS:
            info = await self._get_json(url, path)
            if info is not None:
                return EngineCapacity(
                    max_running_requests=_positive_int(info, "max_running_requests"),
                    max_total_num_tokens=_positive_int(info, "max_total_num_tokens"),
                )
        return EngineCapacity(None, None)

    def forget(self, url: str) -> None:
        self._version_path.pop(url, None)

    async def _get_json(self, url: str, path: str) -> dict[str, Any] | None:
        try:
            response = await self.clients.get(url).get(url + path, timeout=self.timeout_s)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        try:
            payload = json.loads(response.content)
        except ValueError:
            return None
        return payload if isinstance(payload, dict) else None


def _positive_int(info: dict[str, Any], name: str) -> int | None:
    candidates = [info.get(name)]
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        candidates.append(states[0].get(name))
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
