"""Weight-update process groups: the torch.distributed group a trainer and its engines share to broadcast weights.

SGLang's `/init_weights_update_group` protocol builds this group outside the default process group, so neither
side needs `torch.distributed.init_process_group`: a TCP rendezvous at `init_method` (the trainer, rank 0,
hosts the store), a `PrefixStore` named after the group so that several groups can share one store, and
torch's `_new_process_group_helper`. `init_custom_process_group` reproduces SGLang's function of the same
name, so a trainer using it meets real SGLang engines, and the miles engine uses it for its side of the
protocol (one implementation for both: weight-sync's nccl transport and `miles.engine`).

Limits: it relies on torch's private c10d helpers (checked against torch 2.13); group ranks are the identity
mapping 0..world_size-1 (the broadcast source is rank 0, SGLang's convention); group names are global in a
process (torch refuses a second live group with the same name). Creation blocks until every rank joined or
`timeout_s` passed; the same timeout bounds each collective on the group (gloo).
"""

from __future__ import annotations

import datetime
from typing import Any

UPDATE_GROUP_BACKENDS = ("gloo", "nccl")
"""Backends a weight-update group may use: nccl between GPUs, gloo on the CPU."""


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float
) -> Any:
    """A process group outside the default one, built the way SGLang builds its weight-update group.

    Blocks until all `world_size` ranks joined the rendezvous at `init_method` (e.g. "tcp://host:port"; rank 0
    hosts the store). Returns the `ProcessGroup` to pass as `group=` to collectives; the caller destroys it with
    `torch.distributed.destroy_process_group(group)`."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.rendezvous import rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        prefixed,
        group_name=c10d.GroupName(group_name),
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
