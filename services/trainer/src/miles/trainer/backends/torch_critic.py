"""The value head of PPO with a critic (`train.critic`) in the torch backend.

Why a head on the policy and not a separate critic model: the torch backend trains one module (`PackedPolicy`, one
FSDP unit, one AdamW, one state dict keyed by parameter name). A value head registered inside it is sharded,
gathered, checkpointed (`sharded` format, optimizer state) and restored by the code that already does so for the
policy, and costs one (hidden_size + 1)-parameter layer and no extra forward; a second model would double the
trainer's weights, optimizer state and forwards. The price: the critic shares the policy's trunk (its capacity, and
the value loss's gradient reaches the policy's weights, weighted by `value_loss_coef`).

The head maps the policy's final-normed hidden state at a response token's prefix (the row whose logits score the
token) to V(prefix), in float32 whatever the autocast dtype. It starts at zero (V = 0 everywhere, no RNG drawn,
so a critic job samples the same random numbers as any other). It is not part of the published weights (engines
serve the policy only): `hf_state_dict` leaves it out; `full` checkpoints carry it under `CRITIC_PREFIX` names,
which `CheckpointStore` writes to `critic/value_head.safetensors` beside `model/`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from miles.common.errors import ConfigError
from miles.trainer.checkpoint import CRITIC_PREFIX

VALUE_HEAD = "value_head"
"""The head's attribute name in `PackedPolicy` (its parameters are `value_head.weight`, `value_head.bias`)."""


class ValueHead(nn.Module):
    """V(prefix) = w . h + b on final-normed hidden states h (rows, hidden) -> (rows,), float32, zero-initialised."""

    def __init__(self, hidden_size: int, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            values: torch.Tensor = F.linear(hidden.float(), self.weight, self.bias)[:, 0]
        return values


def split_critic_tensors(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(policy weights under Hugging Face names, the value head's under its parameter names) of checkpoint
    tensors."""
    weights = {name: t for name, t in tensors.items() if not name.startswith(CRITIC_PREFIX)}
    head = {name.removeprefix(CRITIC_PREFIX): t for name, t in tensors.items() if name.startswith(CRITIC_PREFIX)}
    return weights, head


def check_critic_tensors(head: Mapping[str, torch.Tensor], has_critic: bool) -> None:
    """A checkpoint's value head (parameter names -> tensors) against the job: a critic job needs exactly its head's
    tensors, a job without a critic none. Raises ConfigError."""
    wanted = {f"{VALUE_HEAD}.weight", f"{VALUE_HEAD}.bias"} if has_critic else set()
    if set(head) == wanted:
        return
    if not has_critic:
        why = "the checkpoint holds a value head (critic/) but this job has no train.critic"
    elif not head:
        why = "this job trains a critic (train.critic) but the checkpoint holds no value head (written without one)"
    else:
        why = f"the checkpoint's value head has tensors {sorted(head)}, the job's has {sorted(wanted)}"
    raise ConfigError(why + ": a job resumes only from its own kind of checkpoint", field="train.critic")
