"""A toy verifiable task and an in-process sampler, for the learning test, the benchmark and smoke runs.

Task: the reward of a response is the fraction of its tokens whose id is below `target_below` (a fixed rule,
checkable without a model). A randomly initialised model hits it at about target_below / vocab_size; a policy
that learns shifts its mass onto those ids. Rollouts are sampled from `miles.model` directly (fast path,
temperature 1, every response exactly `response_tokens` long) and packed as real `miles.common.v1.Group`s with
rollout logprobs and the weight version that produced them, ready to push to the buffer.

Limit: not an agent and not an engine: no KV cache (each token re-runs the whole prefix), so keep sequences
short. It exists to test the trainer, not to generate at scale.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles.model import CausalLM, Segment, block_logprobs
from miles.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ToyTask:
    """Shape of the task and its reward rule."""

    target_below: int = 64
    prompt_tokens: int = 4
    response_tokens: int = 8
    samples_per_group: int = 8

    def reward(self, response: Sequence[int]) -> float:
        return sum(1 for token in response if token < self.target_below) / max(1, len(response))


@torch.no_grad()
def sample_group(
    model: CausalLM,
    task: ToyTask,
    *,
    group_id: str,
    version: int,
    rng: random.Random,
    generator: torch.Generator,
) -> common_pb2.Group:
    """One GRPO group: samples_per_group responses to one random prompt, scored by the task's rule."""
    vocab_size = model.config.vocab_size
    prompt = [rng.randrange(0, vocab_size) for _ in range(task.prompt_tokens)]
    sequences = [list(prompt) for _ in range(task.samples_per_group)]
    logprobs: list[list[float]] = [[] for _ in sequences]
    temperatures = torch.ones(len(sequences))
    for _ in range(task.response_tokens):
        hidden = model.forward_segments([Segment(torch.tensor(s)) for s in sequences])
        last_rows = torch.tensor([sum(len(s) for s in sequences[: i + 1]) - 1 for i in range(len(sequences))])
        step_logprobs = block_logprobs(model, hidden[last_rows], temperatures, deterministic=False)
        tokens = torch.multinomial(step_logprobs.exp(), 1, generator=generator)[:, 0]
        for i, token in enumerate(tokens.tolist()):
            sequences[i].append(token)
            logprobs[i].append(float(step_logprobs[i, token]))
    group = common_pb2.Group(group_id=group_id)
    for i, sequence in enumerate(sequences):
        response = sequence[task.prompt_tokens :]
        sample = group.samples.add(
            sample_id=f"{group_id}/{i}",
            group_id=group_id,
            episode_id=f"{group_id}/{i}",
            tokens=sequence,
            response_start=task.prompt_tokens,
            loss_mask=[1] * len(response),
            rollout_logprobs=logprobs[i],
            reward=task.reward(response),
            status=common_pb2.SAMPLE_STATUS_COMPLETED,
        )
        sample.weight_versions.add(start=0, end=len(response), weight_version=version)
    return group


def mean_reward(groups: Sequence[common_pb2.Group]) -> float:
    rewards = [sample.reward for group in groups for sample in group.samples]
    return sum(rewards) / max(1, len(rewards))
