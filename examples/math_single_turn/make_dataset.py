"""Writes data.jsonl: arithmetic word problems with numeric labels (deterministic: same seed, same file).

python examples/math_single_turn/make_dataset.py [--num-rows 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = "Solve the problem. End your reply with a line `Answer: <number>`."
NAMES = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana"]
ITEMS = ["apples", "marbles", "stamps", "books", "coins", "shells"]


def make_row(rng: random.Random) -> dict[str, object]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        question, answer = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    elif kind == "sub":
        a += b
        question, answer = f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        question, answer = f"{name} fills {a} boxes with {b} {item} each. How many {item} is that?", a * b
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"prompt": messages, "label": str(answer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("data.jsonl"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with args.out.open("w") as handle:
        for _ in range(args.num_rows):
            handle.write(json.dumps(make_row(rng)) + "\n")


if __name__ == "__main__":
    main()
