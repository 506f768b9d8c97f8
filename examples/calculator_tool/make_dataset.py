"""Writes data.jsonl: arithmetic expressions to compute with the calculator tool (deterministic per seed).

    python examples/calculator_tool/make_dataset.py [--num-rows 200] [--seed 0]

Expressions use small integers and + - * with at most one pair of parentheses, so the result is an integer
and a tiny model can learn to copy the expression into one tool call.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = (
    "You are a calculator assistant. Compute the expression by calling the calculator tool, "
    "then reply with a line `Answer: <number>`."
)


def make_expression(rng: random.Random) -> str:
    a, b, c = rng.randint(1, 30), rng.randint(1, 30), rng.randint(2, 9)
    op1, op2 = rng.choice("+-*"), rng.choice("+-*")
    if rng.random() < 0.5:
        return f"({a} {op1} {b}) {op2} {c}"
    return f"{a} {op1} {b} {op2} {c}" if rng.random() < 0.5 else f"{a} {op1} {b}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("data.jsonl"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with args.out.open("w") as handle:
        for _ in range(args.num_rows):
            expression = make_expression(rng)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {expression}?"}]
            row = {"prompt": messages, "label": str(eval(expression)), "expression": expression}
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
