"""How an engine is quiesced for a weight update: the pause modes the engine, weight-sync and the trainer share.

The engine implements SGLang's `/pause_generation` modes (`ENGINE_PAUSE_MODES`); weight-sync and the trainer,
which drive updates, add `drain` (stop routing new requests to the engine at the router, wait for the in-flight
ones, then pause `in_place`).
"""

from __future__ import annotations

from typing import Literal, get_args

EnginePauseMode = Literal["abort", "retract", "in_place"]
"""`/pause_generation` modes: abort in-flight requests, retract them to the queue, or hold them where they are."""

PauseMode = Literal["drain", "abort", "retract", "in_place"]
"""How an updater quiesces an engine: `drain` at the router first, or one of the engine's own modes."""

ENGINE_PAUSE_MODES: tuple[str, ...] = get_args(EnginePauseMode)
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
