"""Writes data.jsonl: small shell tasks with a setup script and a check script (deterministic per seed).

    python examples/terminal_task/make_dataset.py [--num-rows 120] [--seed 0]

Each row: `prompt` (messages), `setup` (shell run in the fresh sandbox before the episode) and `check` (shell
run after it; exit code 0 means the task is solved).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = (
    "You operate a Linux terminal in your working directory. Reply with exactly one shell command inside "
    "<command></command> tags; you will see its output. When the task is done, reply with <done/>."
)
WORDS = ["hello", "orange", "rocket", "violet", "puzzle", "harbor", "lantern", "meadow"]


def make_task(rng: random.Random) -> tuple[str, str, str]:
    """(task text, setup shell, check shell)."""
    kind = rng.randrange(4)
    word, name = rng.choice(WORDS), rng.choice(WORDS)
    if kind == 0:
        return (
            f"Create a file named {name}.txt that contains exactly the word {word}.",
            "true",
            f'test "$(cat {name}.txt)" = "{word}"',
        )
    if kind == 1:
        numbers = [rng.randint(1, 50) for _ in range(rng.randint(2, 5))]
        setup = "printf '" + "\\n".join(map(str, numbers)) + "\\n' > numbers.txt"
        return (
            "The file numbers.txt has one number per line. Write their sum into sum.txt.",
            setup,
            f'test "$(tr -d "[:space:]" < sum.txt)" = "{sum(numbers)}"',
        )
    if kind == 2:
        return (
            f"Create a directory named {name} with an empty file named {word}.log inside it.",
            "true",
            f"test -d {name} && test -f {name}/{word}.log && test ! -s {name}/{word}.log",
        )
    num_lines = rng.randint(3, 12)
    return (
        "How many lines does log.txt have? Write the number into count.txt.",
        f"seq 1 {num_lines} | sed 's/^/entry /' > log.txt",
        f'test "$(tr -d "[:space:]" < count.txt)" = "{num_lines}"',
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-rows", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("data.jsonl"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with args.out.open("w") as handle:
        for _ in range(args.num_rows):
            task, setup, check = make_task(rng)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
            handle.write(json.dumps({"prompt": messages, "setup": setup, "check": check}) + "\n")


if __name__ == "__main__":
    main()
