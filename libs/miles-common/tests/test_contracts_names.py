"""Names shared between services: header spellings and pause modes."""

from __future__ import annotations

from miles.common.contracts import engine_control, headers


def test_header_names_are_the_documented_spellings() -> None:
    assert headers.POOL_HEADER == "X-Miles-Pool"
    assert headers.ROUTING_KEY_HEADER == "X-SMG-Routing-Key"
    assert headers.MIN_WEIGHT_VERSION_HEADER == "X-Miles-Min-Weight-Version"


def test_updaters_know_every_engine_pause_mode_plus_drain() -> None:
    assert engine_control.ENGINE_PAUSE_MODES == ("abort", "retract", "in_place")
    drain, *engine_modes = engine_control.PAUSE_MODES
    assert drain == "drain" and tuple(engine_modes) == engine_control.ENGINE_PAUSE_MODES
