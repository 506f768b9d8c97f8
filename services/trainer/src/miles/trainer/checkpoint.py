"""Durable checkpoints: atomic directories, retention, and the ledger of trained groups.

A checkpoint is `<checkpoint_dir>/step-00000012/`:
- `model/`: a Hugging Face directory (config.json and tokenizer files copied from the initial model, weights in
  `model.safetensors`, float32) that the engine or Hugging Face can load as is (both formats);
- the training state, in one of two formats (`TrainerState.format`; `settings.checkpoint_format` picks the one
  written, the directory's content the one read, so either resumes at any world size):
  - `full`: `optimizer.pt` (optimizer state keyed by parameter name, gathered whole on rank 0) and
    `scheduler.pt` (`torch.save`, loaded with `weights_only=True`); the weights are `model/`'s. On load rank 0
    reads them and the backend scatters them into its shards. Cost on rank 0: the whole model and optimizer state
    in CPU memory (fp32 AdamW: 12 bytes per parameter).
  - `sharded`: `dcp/`, written by every rank with torch.distributed.checkpoint (`save_shards`): each rank writes
    the shards it holds of the weights, AdamW's moments and the scheduler, so no rank holds another's optimizer
    state; on load DCP reads, for each rank, the pieces its new shards cover (another world size re-shards). Every
    rank must see the same checkpoint_dir (a shared volume). `model/` is still gathered on rank 0 (4 bytes per
    parameter, as for every publish).
- LoRA (`train.lora`, `full` format only): `adapter/` in place of `model/`, the adapter in PEFT format
  (`adapter_config.json`, `adapter_model.safetensors`, float32); `optimizer.pt` holds its AdamW state only;
- PPO with a critic (`train.critic`, `full` format): `critic/value_head.safetensors`, the value head (never in
  `model/`, which stays the policy the engines serve); its AdamW state is in `optimizer.pt` with the rest. The
  `sharded` format holds it in `dcp/` like every other parameter;
- `rng.pt`: torch RNG states (rank 0's);
- `trainer_state.json` (`TrainerState`): step, weight version, the ids of the groups this checkpoint commits,
  the dataset cursor, the format and the world size it was written at.
It is written into `.tmp-step-...` (for `sharded` every rank's shards are fsynced before DCP's metadata is
written), every file and directory fsynced, then renamed into place and the parent fsynced: a checkpoint
directory either exists complete or not at all, so its groups are acked only once every rank's part is durable.
Leftover temp directories (a crash while writing) are deleted at start-up.

The ledger `trained_groups.jsonl` has one line per checkpoint: the ids of the groups whose update it made
durable. It is appended only after the checkpoint is durable and cut back to the restored step on start-up, so
its lines are exactly the groups trained into the restored weights (the multiset a crash test compares).

Which rank gathers, writes or loads what (both formats, and `save_shards` / `load_shards`) is checkpoint_ranks.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from miles.common.errors import ConfigError
from miles.model import read_safetensors_dir

STEP_PREFIX = "step-"
TEMP_PREFIX = ".tmp-"
STATE_FILE = "trainer_state.json"
LEDGER_FILE = "trained_groups.jsonl"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
SHARDED_DIR = "dcp"
CRITIC_DIR = "critic"
CRITIC_WEIGHTS_FILE = "value_head.safetensors"
CRITIC_PREFIX = "critic."
"""Checkpoint tensors named `critic.<parameter>` are the value head's: written to `critic/`, not to `model/`."""
_COPIED_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
)


@dataclass
class TrainerState:
    """What a checkpoint says about the trainer. `committed_group_ids`: groups trained since the previous
    checkpoint (acked once this one is durable); `dataset_cursor`: highest (epoch, prompt_index) trained."""

    job_id: str
    step: int
    weight_version: int
    committed_group_ids: list[str] = field(default_factory=list)
    dataset_cursor: dict[str, int] | None = None
    backend: str = ""
    created_at_unix_ms: int = 0
    format: str = "full"
    world_size: int = 1

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TrainerState:
        return cls(**{key: raw[key] for key in cls.__dataclass_fields__ if key in raw})


@dataclass
class LoadedCheckpoint:
    """What rank 0 read. `full`: tensors and optimizer; `sharded`: neither (every rank loads `sharded_dir`)."""

    path: Path
    state: TrainerState
    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    sharded_dir: Path | None = None


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under root (directories after their entries)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def write_hf_dir(
    out_dir: Path,
    tensors: dict[str, torch.Tensor],
    source_model_dir: Path | None,
    *,
    dtype: torch.dtype = torch.float32,
) -> None:
    """An HF model directory: the non-weight files of source_model_dir plus model.safetensors (in `dtype`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if source_model_dir is not None:
        for name in _COPIED_MODEL_FILES:
            if (source_model_dir / name).is_file():
                shutil.copyfile(source_model_dir / name, out_dir / name)
    contiguous = {name: t.detach().to(dtype).contiguous().cpu() for name, t in tensors.items()}
    save_file(contiguous, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def write_adapter_dir(out_dir: Path, tensors: dict[str, torch.Tensor], adapter_config: dict[str, Any]) -> None:
    """A PEFT adapter directory: adapter_config.json and adapter_model.safetensors (float32)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
    contiguous = {name: t.detach().float().contiguous().cpu() for name, t in tensors.items()}
    save_file(contiguous, str(out_dir / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})


def write_critic_dir(out_dir: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The value head's tensors among `tensors` (`critic.` names) into `out_dir/value_head.safetensors` (float32,
    under the head's parameter names; nothing written without them); returns the other tensors."""
    head = {n.removeprefix(CRITIC_PREFIX): t for n, t in tensors.items() if n.startswith(CRITIC_PREFIX)}
    if head:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(
            {n: t.detach().float().contiguous().cpu() for n, t in head.items()}, str(out_dir / CRITIC_WEIGHTS_FILE)
        )
    return {n: t for n, t in tensors.items() if not n.startswith(CRITIC_PREFIX)}


def atomic_publish_dir(temp_dir: Path, final_dir: Path) -> None:
    """fsync temp_dir's tree, rename it to final_dir (replacing an old one), fsync the parent."""
    fsync_tree(temp_dir)
    if final_dir.exists():
        trash = final_dir.with_name(f"{TEMP_PREFIX}old-{final_dir.name}-{uuid.uuid4().hex[:8]}")
        final_dir.rename(trash)
        temp_dir.rename(final_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        temp_dir.rename(final_dir)
    fsync_path(final_dir.parent)


class CheckpointStore:
    """The checkpoints of one job under `root`."""

    def __init__(
        self,
        root: Path,
        *,
        keep_last: int,
        source_model_dir: Path | None,
        adapter_config: dict[str, Any] | None = None,
    ) -> None:
        """`adapter_config`: LoRA jobs, the PEFT adapter_config.json content; checkpoints then hold `adapter/`."""
        self.root = root
        self.keep_last = keep_last
        self.source_model_dir = source_model_dir
        self.adapter_config = adapter_config
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}{step:08d}"

    def remove_temporaries(self) -> int:
        removed = 0
        for path in self.root.glob(f"{TEMP_PREFIX}*"):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
        return removed

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        found = []
        for path in self.root.glob(f"{STEP_PREFIX}*"):
            suffix = path.name.removeprefix(STEP_PREFIX)
            if suffix.isdigit() and (path / STATE_FILE).is_file():
                found.append(int(suffix))
        return sorted(found)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def write(
        self, state: TrainerState, tensors: dict[str, torch.Tensor], optimizer: dict[str, Any], rng: dict[str, Any]
    ) -> Path:
        """Write a `full` checkpoint atomically and durably; then apply retention. Returns its directory."""
        temp = self.begin(state.step, sharded=False)
        torch.save(optimizer.get("optimizer", {}), temp / "optimizer.pt")
        torch.save(optimizer.get("scheduler", {}), temp / "scheduler.pt")
        state.format = "full"
        return self.commit(temp, state, tensors, rng)

    def begin(self, step: int, *, sharded: bool) -> Path:
        """A fresh temp directory for the checkpoint of `step` (with its empty `dcp/` for the ranks' shards)."""
        temp = self.root / f"{TEMP_PREFIX}{self.path_for(step).name}-{uuid.uuid4().hex[:8]}"
        temp.mkdir(parents=True)
        if sharded:
            (temp / SHARDED_DIR).mkdir()
        return temp

    def commit(self, temp: Path, state: TrainerState, tensors: dict[str, torch.Tensor], rng: dict[str, Any]) -> Path:
        """Add the HF export, RNG and state to `temp`, then make it the durable checkpoint of `state.step`."""
        final = self.path_for(state.step)
        tensors = write_critic_dir(temp / CRITIC_DIR, tensors)
        if self.adapter_config is not None:
            write_adapter_dir(temp / ADAPTER_DIR, tensors, self.adapter_config)
        else:
            write_hf_dir(temp / MODEL_DIR, tensors, self.source_model_dir)
        torch.save(rng, temp / "rng.pt")
        state.created_at_unix_ms = int(time.time() * 1000)
        (temp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1, sort_keys=True))
        atomic_publish_dir(temp, final)
        self._retain()
        return final

    def read_state(self, step: int) -> TrainerState:
        return TrainerState.from_json(json.loads((self.path_for(step) / STATE_FILE).read_text()))

    def load(self, step: int) -> LoadedCheckpoint:
        """Rank 0's part of a restore: everything of a `full` checkpoint; state and RNG of a `sharded` one."""
        path = self.path_for(step)
        state = self.read_state(step)
        rng = torch.load(path / "rng.pt", weights_only=True)
        if (path / SHARDED_DIR).is_dir():
            return LoadedCheckpoint(path, state, tensors={}, optimizer={}, rng=rng, sharded_dir=path / SHARDED_DIR)
        return LoadedCheckpoint(
            path=path,
            state=state,
            tensors=self._read_weights(path),
            optimizer={
                "optimizer": torch.load(path / "optimizer.pt", weights_only=True),
                "scheduler": torch.load(path / "scheduler.pt", weights_only=True),
            },
            rng=rng,
        )

    def _read_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """`model/`'s weights, or with LoRA `adapter/`'s (a checkpoint of the other kind is refused), and the value
        head under `critic.` names when the checkpoint has one (the backend checks that it fits the job)."""
        has_adapter = (path / ADAPTER_DIR).is_dir()
        if has_adapter != (self.adapter_config is not None):
            raise ConfigError(
                f"{path} holds {'a LoRA adapter' if has_adapter else 'full weights'} but this job "
                f"{'trains a LoRA adapter' if self.adapter_config is not None else 'has no train.lora'}: a job "
                "resumes only from its own kind of checkpoint",
                field="train.lora",
            )
        if has_adapter:
            weights = load_file(str(path / ADAPTER_DIR / ADAPTER_WEIGHTS_FILE))
        else:
            weights = read_safetensors_dir(path / MODEL_DIR)
        head_file = path / CRITIC_DIR / CRITIC_WEIGHTS_FILE
        head = load_file(str(head_file)) if head_file.is_file() else {}
        return weights | {CRITIC_PREFIX + name: tensor for name, tensor in head.items()}

    def _retain(self) -> None:
        steps = self.steps()
        for step in steps[: max(0, len(steps) - self.keep_last)]:
            shutil.rmtree(self.path_for(step), ignore_errors=True)

    # --- the ledger of trained groups -------------------------------------------------------------------

    @property
    def ledger_path(self) -> Path:
        return self.root / LEDGER_FILE

    def read_ledger(self) -> list[dict[str, Any]]:
        if not self.ledger_path.is_file():
            return []
        entries = []
        for line in self.ledger_path.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from a crash mid-append: everything after it is rewritten
        return entries

    def append_ledger(self, step: int, group_ids: Iterable[str]) -> None:
        with self.ledger_path.open("a") as ledger:
            ledger.write(json.dumps({"step": step, "group_ids": list(group_ids)}) + "\n")
            ledger.flush()
            os.fsync(ledger.fileno())

    def reconcile_ledger(self, state: TrainerState | None) -> None:
        """Cut the ledger back to the restored checkpoint and make sure that checkpoint's own line is there."""
        restored_step = state.step if state is not None else 0
        entries = [e for e in self.read_ledger() if int(e["step"]) <= restored_step]
        if state is not None and state.committed_group_ids and not any(int(e["step"]) == state.step for e in entries):
            entries.append({"step": state.step, "group_ids": list(state.committed_group_ids)})
        temp = self.root / f"{TEMP_PREFIX}{LEDGER_FILE}"
        temp.write_text("".join(json.dumps(e) + "\n" for e in entries))
        fsync_path(temp)
        temp.rename(self.ledger_path)
        fsync_path(self.root)

    def trained_group_ids(self) -> list[str]:
        """Every group id in the ledger, in training order (a multiset: repeats would mean double training)."""
        return [gid for entry in self.read_ledger() for gid in entry["group_ids"]]


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
