"""Writes data.jsonl: small arithmetic questions for a solver and a verifier (deterministic: same seed, same file).

    python examples/solver_verifier/make_dataset.py [--num-rows 200] [--seed 0]

Each row has the solver's `prompt` (OpenAI messages), the bare `question` (what the verifier is shown beside the
solver's answer) and the `label` (the right answer). Operands are small and results are integers, so that a tiny
model is right now and then and both roles get a reward signal.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SOLVER_SYSTEM = "Solve the arithmetic problem. End your reply with a line `Answer: <number>`."


def make_row(rng: random.Random) -> dict[str, object]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
    question = f"What is {a} {op} {b}?"
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    messages = [{"role": "system", "content": SOLVER_SYSTEM}, {"role": "user", "content": question}]
    return {"prompt": messages, "question": question, "label": str(answer)}


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
