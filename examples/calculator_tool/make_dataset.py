"""Writes data.jsonl: arithmetic expressions to compute with the calculator tool (deterministic per seed).

    python examples/calculator_tool/make_dataset.py [--num-rows 200] [--seed 0]
    python examples/calculator_tool/make_dataset.py --num-rows 48 --seed 101 --exclude data.jsonl --out eval.jsonl

The second form writes the held-out prompts `make run` evaluates on: no expression of the training set.

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
    parser.add_argument("--exclude", type=Path, help="a dataset whose expressions must not appear")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    excluded = set()
    if args.exclude is not None:
        excluded = {json.loads(line)["expression"] for line in args.exclude.read_text().splitlines() if line.strip()}
    written: list[str] = []
    with args.out.open("w") as handle:
        while len(written) < args.num_rows:
            expression = make_expression(rng)
            if expression in excluded or (excluded and expression in written):
                continue  # held-out prompts: none of the training set, none twice
            written.append(expression)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {expression}?"}]
            row = {"prompt": messages, "label": str(eval(expression)), "expression": expression}
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
