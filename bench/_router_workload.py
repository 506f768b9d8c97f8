"""The multi-turn agent workload `make bench-router` replays, and the script that wrote it.

`python bench/_router_workload.py` rewrites bench/data/router_workload.json (deterministic: same seed, same bytes).
The file records the *shape* of an agentic RL rollout — who talks when, and how many tokens — not token ids:
those are derived from seeds at replay time (`seeded_tokens`), which keeps the file small and the replay exact.

Shape (a tool-using agent trained with GRPO):
- 50 prompts x 4 episodes = 200 episodes, listed in the order a rollout worker starts them (a group's episodes
  one after another). The episodes of a group share their first prompt token for token;
- every first prompt = a system prompt with tool schemas shared by every episode (400 tokens) + the task
  (100-300 tokens);
- 10-40 turns per episode: most episodes end after 10-15 turns, one in ten runs 20-40. In each turn the model samples
  4-24 tokens (a short tool call or answer; replayed with ignore_eos so lengths are exact) and the tool answers
  20-150 tokens, or, with probability 0.08, a long output of 500-1,500 tokens (a file, a test log);
- the next turn's prompt is the previous prompt + the sampled output ids + the tool output (token in, token out),
  so the context grows every turn.

`max_cached_tokens` is the trace's theoretical maximum of cached prompt tokens: every turn finds its previous
turn's prompt + output cached (SGLang caches all but the last output token), an episode's first turn finds its
group's prompt cached when a sibling started earlier, and the shared system prompt when any episode did.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_PATH = Path(__file__).resolve().parent / "data" / "router_workload.json"
SEED = 0
NUM_GROUPS = 50
EPISODES_PER_GROUP = 4
SYSTEM_PROMPT_TOKENS = 400
TASK_TOKENS = (100, 300)
TURNS = (10, 40)
LONG_EPISODE_PROBABILITY = 0.1
OUTPUT_TOKENS = (4, 24)
TOOL_TOKENS = (20, 150)
LONG_TOOL_TOKENS = (500, 1500)
LONG_TOOL_PROBABILITY = 0.08
TOKEN_ID_RANGE = (1000, 150_000)  # regular Qwen3 vocabulary, clear of the special tokens


@dataclass(frozen=True)
class Turn:
    num_new_tokens: int
    """Tokens appended to the context before this turn (0 for the first turn: the first prompt is the group's)."""
    max_new_tokens: int
    """Tokens the model samples in this turn."""


@dataclass(frozen=True)
class Episode:
    episode_id: str
    group: int
    seed: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    system_seed: int
    num_system_tokens: int
    task_seeds: tuple[int, ...]
    num_task_tokens: tuple[int, ...]
    episodes: tuple[Episode, ...]

    def first_prompt(self, group: int) -> list[int]:
        return seeded_tokens(self.system_seed, self.num_system_tokens) + seeded_tokens(
            self.task_seeds[group], self.num_task_tokens[group]
        )

    def prompt_lengths(self) -> Iterator[tuple[Episode, int, int]]:
        """(episode, turn index, prompt length) for every request of the trace, in trace order."""
        for episode in self.episodes:
            length = self.num_system_tokens + self.num_task_tokens[episode.group]
            for index, turn in enumerate(episode.turns):
                if index:
                    length += episode.turns[index - 1].max_new_tokens + turn.num_new_tokens
                yield episode, index, length


_TOKEN_IDS = range(*TOKEN_ID_RANGE)


def seeded_tokens(seed: int, num_tokens: int) -> list[int]:
    return random.Random(seed).choices(_TOKEN_IDS, k=num_tokens)


def tool_tokens(episode: Episode, turn_index: int) -> list[int]:
    """The tool output appended before turn `turn_index` of an episode."""
    return seeded_tokens(episode.seed * 1000 + turn_index, episode.turns[turn_index].num_new_tokens)


def build(seed: int = SEED) -> dict[str, Any]:
    rng = random.Random(seed)
    groups = [
        {"task_seed": rng.randrange(1 << 30), "num_task_tokens": rng.randint(*TASK_TOKENS)} for _ in range(NUM_GROUPS)
    ]
    episodes = []
    for group in range(NUM_GROUPS):
        for sibling in range(EPISODES_PER_GROUP):
            if rng.random() < LONG_EPISODE_PROBABILITY:
                num_turns = rng.randint(20, TURNS[1])
            else:
                num_turns = min(TURNS[1], TURNS[0] + int(rng.expovariate(1 / 3)))
            turns = []
            for index in range(num_turns):
                if index == 0:
                    num_new = 0
                elif rng.random() < LONG_TOOL_PROBABILITY:
                    num_new = rng.randint(*LONG_TOOL_TOKENS)
                else:
                    num_new = rng.randint(*TOOL_TOKENS)
                turns.append([num_new, rng.randint(*OUTPUT_TOKENS)])
            episodes.append(
                {"id": f"g{group:02d}-e{sibling}", "group": group, "seed": rng.randrange(1 << 30), "turns": turns}
            )
    return {
        "description": "multi-turn tool-using agent, GRPO groups of 4; written by bench/_router_workload.py",
        "seed": seed,
        "system_prompt": {"seed": rng.randrange(1 << 30), "num_tokens": SYSTEM_PROMPT_TOKENS},
        "groups": groups,
        "episodes": episodes,
    }


def load(path: Path = TRACE_PATH) -> Workload:
    raw = json.loads(path.read_text())
    return Workload(
        system_seed=raw["system_prompt"]["seed"],
        num_system_tokens=raw["system_prompt"]["num_tokens"],
        task_seeds=tuple(group["task_seed"] for group in raw["groups"]),
        num_task_tokens=tuple(group["num_task_tokens"] for group in raw["groups"]),
        episodes=tuple(
            Episode(item["id"], item["group"], item["seed"], tuple(Turn(new, out) for new, out in item["turns"]))
            for item in raw["episodes"]
        ),
    )


def max_cached_tokens(workload: Workload) -> tuple[int, int]:
    """(theoretical maximum of cached prompt tokens, prompt tokens) over the whole trace (module docstring)."""
    best = total = 0
    groups_started: set[int] = set()
    previous = 0
    for episode, index, length in workload.prompt_lengths():
        total += length
        if index:
            best += previous + episode.turns[index - 1].max_new_tokens - 1
        elif episode.group in groups_started:
            best += length - 1
        elif groups_started:
            best += workload.num_system_tokens
        groups_started.add(episode.group)
        previous = length
    return best, total


def main() -> None:
    TRACE_PATH.parent.mkdir(parents=True, exist_ok=True)
    TRACE_PATH.write_text(json.dumps(build(), separators=(",", ":")) + "\n")
    workload = load()
    best, total = max_cached_tokens(workload)
    lengths = [length for _, _, length in workload.prompt_lengths()]
    print(
        f"{TRACE_PATH.name}: {len(workload.episodes)} episodes, {len(lengths)} turns, "
        f"{total} prompt tokens (mean {total / len(lengths):.0f}, max {max(lengths)}), "
        f"theoretical max hit rate {best / total:.4f}"
    )


if __name__ == "__main__":
    main()
