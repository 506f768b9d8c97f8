"""How the ranks take part in a checkpoint: rank 0 writing one (`write_checkpoint`) and restoring one
(`restore_checkpoint`), the collective save and load of each rank's shards (`save_shards`, `load_shards`, the
`sharded` format), and the start-up check that the backend can give sharded state.

The directory layout, its atomic commit, the ledger and the RNG state are checkpoint.py's; this module decides
which rank gathers or writes what. Every runner operation goes through `compute`, the loop's compute thread: the
only thread issuing torch.distributed collectives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.common.errors import ConfigError
from miles.trainer.checkpoint import (
    SHARDED_DIR,
    CheckpointStore,
    LoadedCheckpoint,
    TrainerState,
    restore_rng,
    rng_state,
)
from miles.trainer.errors import CheckpointDirNotSharedError

if TYPE_CHECKING:
    from miles.trainer.backends.base import TrainBackend
    from miles.trainer.distributed import RankRunner


async def write_checkpoint(
    store: CheckpointStore,
    runner: RankRunner,
    compute: Callable[..., Awaitable[Any]],
    state: TrainerState,
    checkpoint_format: str,
) -> Path:
    """Rank 0: the checkpoint of `state`, durable on return; `compute` runs a runner operation on the compute thread
    (the only one issuing collectives). `full`: rank 0 gathers everything and writes it; `sharded`: every rank writes
    its shards into rank 0's temp directory, then rank 0 adds the HF export and commits."""
    if checkpoint_format == "full":
        tensors, optimizer = await compute(runner.full_state)
        return await asyncio.to_thread(store.write, state, tensors, optimizer, rng_state())
    temp = await asyncio.to_thread(store.begin, state.step, sharded=True)
    await compute(runner.save_sharded, str(temp / SHARDED_DIR))
    tensors = await compute(runner.hf_tensors)
    state.format = "sharded"
    return await asyncio.to_thread(store.commit, temp, state, tensors, rng_state())


async def restore_checkpoint(
    store: CheckpointStore,
    runner: RankRunner,
    compute: Callable[..., Awaitable[Any]],
    step: int,
) -> LoadedCheckpoint:
    """Rank 0: load the checkpoint of `step` into every rank and restore rank 0's RNG. `full`: rank 0 reads the
    weights and optimizer state and the backend scatters them; `sharded`: every rank reads its own shards (any world
    size)."""
    loaded = await asyncio.to_thread(store.load, step)
    if loaded.sharded_dir is not None:
        await compute(runner.load_sharded, str(loaded.sharded_dir))
    else:
        await compute(runner.load_state, loaded.tensors, loaded.optimizer)
    restore_rng(loaded.rng)
    return loaded


def check_checkpoint_format(checkpoint_format: str, backend: TrainBackend) -> None:
    """At start-up: refuse `sharded` with a backend that cannot give sharded state."""
    from miles.trainer.backends.base import TrainBackend

    if checkpoint_format == "sharded" and type(backend).sharded_state is TrainBackend.sharded_state:
        raise ConfigError(
            f"checkpoint_format 'sharded' needs sharded state, which the {backend.name} backend cannot give; use "
            "'full'",
            field="checkpoint_format",
        )


def save_shards(backend: TrainBackend, directory: Path) -> None:
    """Collective (every rank, same directory): write this rank's shards of the training state with
    torch.distributed.checkpoint. Returns on rank 0 once every rank's files are written and fsynced and DCP's
    metadata is written; nothing is gathered."""
    from torch.distributed.checkpoint.state_dict_saver import save

    state = _sharded_state(backend)
    if not directory.is_dir():
        raise CheckpointDirNotSharedError(
            f"{directory}, created by rank 0, is not visible here: checkpoint_format 'sharded' needs a checkpoint_dir "
            "that every rank mounts (a shared volume); use 'full' with a directory per rank"
        )
    save(state, checkpoint_id=str(directory))


def load_shards(backend: TrainBackend, directory: Path) -> None:
    """Collective: load a `save_shards` directory into this rank's shards, whatever world size wrote it."""
    from torch.distributed.checkpoint.state_dict_loader import load

    state = _sharded_state(backend)
    if not directory.is_dir():
        raise CheckpointDirNotSharedError(f"{directory} (the checkpoint rank 0 restores) is not visible here")
    load(state, checkpoint_id=str(directory))
    backend.load_sharded_state(state)


def _sharded_state(backend: TrainBackend) -> dict[str, Any]:
    state: dict[str, Any] | None = backend.sharded_state()
    if state is None:
        raise ConfigError(
            f"the {backend.name} backend cannot give sharded state: use checkpoint_format 'full'",
            field="checkpoint_format",
        )
    return state
