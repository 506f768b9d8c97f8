"""TITO vs full re-render: per-turn tokenization time along one agent episode, measured side by side.

One Qwen3 agent episode (real Qwen3 tokenizer, qwen3 family) of 50 turns - each an assistant tool call and a
~600-token tool output - grows to ~30K tokens of context (the shape of the agent sessions this is for: the
session path measured 36-44x there before TITO was bounded). The episode is played with TITO, checking at every
reported turn that TITO's ids equal a full re-render's. Then, for the prompts of turns 10, 25 and 50, both ways
of building the next prompt are timed in interleaved rounds (so machine noise hits all of them alike; the
fastest round counts): TITO (`extend`: render a tiny synthetic base with and without the appended message,
encode only the difference, then materialise the whole id list) and a full re-render + re-encode of the
history. Prints `tito_speedup turns=<n> ratio=<x>` (re-render time / TITO time; goal at turns=50: >= 50) and
TITO's per-turn time at each point (flat: it does not grow with the context); writes bench/results/tito.json with
the machine it ran on.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.common.testing.machine import describe_machine
from miles.session.tito import TitoTokenizer, get_family
from miles.session.tito.assets import bundled_codec
from miles.session.tito.conformance import simulate_completion

NUM_TURNS = 50
TARGET_CONTEXT_TOKENS = 30_000
REPORT_AT_TURNS = (10, 25, 50)
SPEEDUP_GOAL = 50.0
"""tito_speedup at the last turn (turns=50, ~30K tokens) this bench must reach."""
ROUNDS = 30
FULL_RERENDER_EVERY = 3
"""The full re-render (~100x slower) is timed in every 3rd round only."""
RESULTS = Path(__file__).parent / "results" / "tito.json"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]
_WORDS = ("alpha", "beta", "gamma", "delta", "request", "worker", "batch", "latency", "cache", "token", "prefix",
          "session", "engine", "ok", "retry")  # fmt: skip


@dataclass(frozen=True)
class TurnState:
    """Everything needed to build the prompt after one turn: stored ids, the history, the appended message."""

    stored_ids: list[int]
    history: list[dict[str, Any]]
    appended: list[dict[str, Any]]


def _log_text(rng: random.Random, num_lines: int) -> str:
    return "\n".join(
        f"{i:05d} {rng.choice(_WORDS)}-{rng.randint(0, 99)} {' '.join(rng.choices(_WORDS, k=6))} {rng.random():.4f}"
        for i in range(num_lines)
    )


def play_episode(tito: TitoTokenizer) -> dict[int, TurnState]:
    """Play the episode with TITO; returns the state at each reported turn. Fails if TITO != full re-render."""
    rng = random.Random(0)
    tokens_per_line = len(tito.codec.encode(_log_text(random.Random(1), 50))) / 50
    lines_per_turn = max(1, round(TARGET_CONTEXT_TOKENS / NUM_TURNS / tokens_per_line) - 1)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the shell."},
        {"role": "user", "content": "Investigate the worker logs and report anomalies."},
    ]
    prompt = tito.first_prompt(history, tools=TOOLS)
    states: dict[int, TurnState] = {}
    for turn in range(1, NUM_TURNS + 1):
        arguments = json.dumps({"command": f"sed -n {turn}p worker.log"})
        call = {"id": f"call_{turn}", "type": "function", "function": {"name": "run_shell", "arguments": arguments}}
        reply = {"role": "assistant", "content": "", "reasoning_content": f"Check part {turn}.", "tool_calls": [call]}
        stored = [*prompt.prompt_ids, *tito.codec.encode(simulate_completion(tito, history, reply, TOOLS))]
        history.append(reply)
        appended = [{"role": "tool", "tool_call_id": call["id"], "content": _log_text(rng, lines_per_turn)}]
        prompt = tito.extend(stored, history, appended, tools=TOOLS)
        if turn in REPORT_AT_TURNS:
            states[turn] = TurnState(stored, list(history), appended)
            if prompt.prompt_ids != _full_rerender(tito, states[turn]):
                raise SystemExit(f"TITO ids differ from the full re-render at turn {turn}")
        history.extend(appended)
    return states


def _tito(tito: TitoTokenizer, state: TurnState) -> list[int]:
    # Materialising the whole id list is part of the cost: a caller sends it to the engine.
    return tito.extend(state.stored_ids, state.history, state.appended, tools=TOOLS).prompt_ids


def _full_rerender(tito: TitoTokenizer, state: TurnState) -> list[int]:
    text = tito.render([*state.history, *state.appended], tools=TOOLS, add_generation_prompt=True)
    return tito.codec.encode(text)


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(tito: TitoTokenizer, states: dict[int, TurnState]) -> list[dict[str, Any]]:
    best: dict[tuple[int, str], float] = {}
    for round_index in range(ROUNDS):
        ways = (
            (("tito", _tito), ("full", _full_rerender))
            if round_index % FULL_RERENDER_EVERY == 0
            else (("tito", _tito),)
        )
        for turn, state in states.items():
            for way, fn in ways:
                elapsed = _time(lambda f=fn, s=state: f(tito, s))  # type: ignore[misc]
                best[turn, way] = min(best.get((turn, way), float("inf")), elapsed)
    return [
        {
            "turns": turn,
            "context_tokens": len(state.stored_ids),
            "tito_ms_per_turn": round(best[turn, "tito"] * 1e3, 3),
            "full_rerender_ms_per_turn": round(best[turn, "full"] * 1e3, 3),
            "ratio": round(best[turn, "full"] / best[turn, "tito"], 1),
        }
        for turn, state in states.items()
    ]


def main() -> None:
    codec = bundled_codec("qwen3")
    tito = TitoTokenizer(get_family("qwen3"), codec)
    points = measure(tito, play_episode(tito))
    flatness = round(points[-1]["tito_ms_per_turn"] / points[0]["tito_ms_per_turn"], 2)
    for p in points:
        print(
            f"tito turns={p['turns']} context_tokens={p['context_tokens']} tito_ms_per_turn={p['tito_ms_per_turn']} "
            f"full_rerender_ms_per_turn={p['full_rerender_ms_per_turn']}"
        )
    print(f"tito_per_turn_cost turn{NUM_TURNS}_over_turn{REPORT_AT_TURNS[0]}={flatness} ids_equal_full_render=true")
    for p in points:
        goal = (
            f" (goal >= {SPEEDUP_GOAL:g}: {'met' if p['ratio'] >= SPEEDUP_GOAL else 'NOT met'})"
            if p is points[-1]
            else ""
        )
        print(f"tito_speedup turns={p['turns']} ratio={p['ratio']}{goal}")
    report = {
        "family": "qwen3",
        "tokenizer": codec.name,
        "num_turns": NUM_TURNS,
        "rounds_fastest_of": {"tito": ROUNDS, "full_rerender": -(-ROUNDS // FULL_RERENDER_EVERY)},
        "points": points,
        "tito_cost_last_over_first_point": flatness,
        "speedup_goal_at_last_point": SPEEDUP_GOAL,
        "machine": describe_machine(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
