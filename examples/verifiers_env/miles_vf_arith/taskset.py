"""The taskset: procedurally generated arithmetic (`a op b`), scored by verifiers' own boxed-answer check plus
partial credit for the right number without the format (a policy that has not learned `\\boxed{}` still gets a
signal to learn from; 0.75 + 0.25 = 1.0 for a right first answer).

Rows are a pure function of `seed`, `num_tasks` and `max_operand` (a seeded `random.Random`), so every
environment server of a job serves the same rows in the same order.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

SYSTEM_PROMPT = "You are a careful calculator. Think briefly, then give the final answer as \\boxed{N}."
RETRY_CREDIT = 0.5
"""The reward of a right answer given only after the environment's feedback (a first-try answer gets 1.0)."""
_OPERATIONS = ("+", "-", "*")
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?![\d.])")


class ArithData(vf.TaskData):
    answer: str
    """The exact result, as an integer in decimal."""


def num_attempts(trace: vf.Trace) -> int:
    """The user turns the policy answered: the task's prompt, and the environment's feedback when it came."""
    return sum(1 for message in trace.messages if message.role == "user")


class ArithTask(vf.Task[ArithData]):
    def is_correct(self, reply: str) -> bool:
        """Whether the last `\\boxed{}` of `reply` equals the answer (math-verify, as verifiers scores math)."""
        return vf.verify_boxed_math_answer(reply, self.data.answer) == 1.0

    @vf.reward(weight=0.75)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 for the right final answer at the first attempt, RETRY_CREDIT at the second, else 0.0."""
        if not self.is_correct(trace.last_reply):
            return 0.0
        return 1.0 if num_attempts(trace) == 1 else RETRY_CREDIT

    @vf.reward(weight=0.25)
    async def last_number(self, trace: vf.Trace) -> float:
        """1.0 when the last number of the final reply is the answer, boxed or not."""
        numbers = _NUMBER.findall(trace.last_reply)
        return 1.0 if numbers and int(numbers[-1]) == int(self.data.answer) else 0.0

    @vf.metric
    async def attempts(self, trace: vf.Trace) -> float:
        return float(num_attempts(trace))


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 64
    """How many problems to generate."""
    seed: int = 0
    """The generator's seed: same seed, same problems."""
    max_operand: int = 20
    """Operands are drawn from [0, max_operand]."""


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for index in range(self.config.num_tasks):
            left, right = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            operation = rng.choice(_OPERATIONS)
            result = {"+": left + right, "-": left - right, "*": left * right}[operation]
            data = ArithData(
                id=f"arith-{self.config.seed}-{index}",
                prompt=f"What is {left} {operation} {right}?",
                system_prompt=SYSTEM_PROMPT,
                answer=str(result),
            )
            tasks.append(ArithTask(data, self.config.task))
        return tasks
