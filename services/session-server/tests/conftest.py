"""Shared fixtures of the session-server tests: TITO tokenizers on the real offline assets.

Tests run with --import-mode=importlib, so helpers are handed out as fixtures rather than imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from miles.session.tito import Family, TitoTokenizer, get_family
from miles.session.tito.assets import verification_codec

WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def weather_call(city: str = "Paris", arguments: str | None = None, call_id: str = "call_0") -> dict[str, Any]:
    args = arguments if arguments is not None else f'{{"city": "{city}"}}'
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}


def make_tito(name: str, **family_changes: Any) -> TitoTokenizer:
    """The family's TITO tokenizer on its verification codec, optionally with family fields replaced."""
    family: Family = get_family(name)
    if family_changes:
        family = dataclasses.replace(family, **family_changes)
    return TitoTokenizer(family, verification_codec(get_family(name)))


@pytest.fixture(name="weather_tools", scope="session")
def weather_tools_fixture() -> list[dict[str, Any]]:
    return WEATHER_TOOLS


@pytest.fixture(name="weather_call", scope="session")
def weather_call_fixture() -> Callable[..., dict[str, Any]]:
    return weather_call


@pytest.fixture(name="make_tito", scope="session")
def make_tito_fixture() -> Callable[..., TitoTokenizer]:
    return make_tito


@pytest.fixture(scope="session")
def qwen3() -> TitoTokenizer:
    return make_tito("qwen3")


@pytest.fixture(scope="session")
def glm47() -> TitoTokenizer:
    return make_tito("glm-4.7")
