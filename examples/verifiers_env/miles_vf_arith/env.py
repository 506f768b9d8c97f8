"""The environment: the multi-turn protocol. The model answers; a wrong answer gets the environment's feedback
as a user turn and one more attempt.

It is verifiers' own turn-by-turn machinery (`Agent.interaction`: the environment is the run's user, each
`turn()` one harness segment), on the tool-less `null` harness (verifiers' chat program) in a local subprocess.
"""

from __future__ import annotations

import verifiers.v1 as vf

from miles_vf_arith.taskset import ArithTask

FEEDBACK = "That is not correct. Check your work and give the final answer as \\boxed{N} again."


class ArithRetryEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=2)
    """The policy's seat: verifiers' chat program, at most two model turns (the answer and the retry)."""
    feedback: str = FEEDBACK
    """The user turn that follows a wrong first answer."""


class ArithRetryEnv(vf.Env[ArithRetryEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        if not isinstance(task, ArithTask):
            raise TypeError(f"ArithRetryEnv plays ArithTask, got {type(task).__name__}")
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()  # the task's prompt opens the exchange
            if first.terminated or task.is_correct(first.last_reply):
                return
            await chat.turn(self.config.feedback)
