"""Grades /app/fizzbuzz.py: reward = share of the 15 expected lines printed right (Harbor's reward.json)."""

import json
import subprocess
import sys

program, reward_path = sys.argv[1], sys.argv[2]
expected = [
    "FizzBuzz" if n % 15 == 0 else "Fizz" if n % 3 == 0 else "Buzz" if n % 5 == 0 else str(n) for n in range(1, 16)
]
try:
    done = subprocess.run([sys.executable, program], capture_output=True, text=True, timeout=10)
    lines = done.stdout.splitlines()
except (OSError, subprocess.TimeoutExpired) as exc:
    print(f"could not run {program}: {exc}")
    lines = []
num_right = sum(1 for got, want in zip(lines, expected, strict=False) if got.strip() == want)
print(f"{num_right} of {len(expected)} lines right")
with open(reward_path, "w") as out:
    json.dump({"reward": num_right / len(expected), "lines_right": num_right}, out)
