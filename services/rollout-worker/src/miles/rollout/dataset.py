"""The job's prompts: rows of a JSONL or Parquet file, visited in a seeded permutation per epoch.

A position in the job's stream of prompts is a sequence number `seq` (0, 1, 2, ...): `epoch = seq // len`,
and the prompt is the `seq % len`-th entry of that epoch's permutation. The permutation depends only on the
seed, the epoch and the dataset's length, so every worker (and every restart) maps a seq to the same prompt;
the cursor (`cursor.py`) hands out seqs.

Limits: the file is read whole into memory at start-up (prompts, not trajectories: a million short prompts is a
few hundred MB). Remote URLs need their fsspec filesystem installed (`s3fs`, `gcsfs`); the image ships none.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import fsspec  # type: ignore[import-untyped]

from miles.common.jobspec.rollout import DatasetSpec
from miles.rollout.errors import DatasetError


@dataclass(frozen=True)
class PromptRef:
    """Where a seq points: the epoch and the row index in the file."""

    seq: int
    epoch: int
    prompt_index: int


def _read_rows(spec: DatasetSpec) -> list[dict[str, Any]]:
    if spec.path is None:
        raise DatasetError("rollout.dataset.path is required with an agent", field="dataset.path")
    is_parquet = spec.format == "parquet" or (spec.format == "auto" and spec.path.endswith(".parquet"))
    try:
        if is_parquet:
            import pyarrow.parquet as pq  # type: ignore[import-untyped]

            with fsspec.open(spec.path, "rb", **spec.storage_options) as handle:
                rows: list[dict[str, Any]] = pq.read_table(handle).to_pylist()
            return rows
        rows = []
        with fsspec.open(spec.path, "rt", encoding="utf-8", **spec.storage_options) as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise DatasetError(f"{spec.path}:{line_number}: a row must be a JSON object", field="dataset.path")
                rows.append(row)
                if spec.limit is not None and len(rows) >= spec.limit:
                    break
        return rows
    except DatasetError:
        raise
    except (OSError, ValueError, ImportError) as exc:
        raise DatasetError(
            f"cannot read dataset {spec.path!r}: {type(exc).__name__}: {exc}", field="dataset.path"
        ) from exc


def _messages(value: Any, index: int, prompt_key: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return [dict(message) for message in value]
    raise DatasetError(
        f"row {index}: field {prompt_key!r} must be a string or a non-empty list of messages with a role",
        field="dataset.prompt_key",
    )


class Dataset:
    """The rows of the file with their prompt as OpenAI messages, and the per-epoch permutations."""

    def __init__(self, spec: DatasetSpec, rows: list[dict[str, Any]], *, extra_fingerprint: str = "") -> None:
        if not rows:
            raise DatasetError(f"dataset {spec.path or 'of the environment'} has no rows", field="dataset.path")
        self.spec = spec
        self.extra_fingerprint = extra_fingerprint
        self._rows = [
            {**row, "messages": _messages(row.get(spec.prompt_key), i, spec.prompt_key)} for i, row in enumerate(rows)
        ]
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def fingerprint(self) -> str:
        """What the order of prompts depends on; a cursor made for another fingerprint cannot be resumed."""
        base = f"rows={len(self)};shuffle={self.spec.shuffle};seed={self.spec.seed}"
        return f"{base};{self.extra_fingerprint}" if self.extra_fingerprint else base

    @property
    def num_seqs(self) -> int | None:
        """Seqs in the whole job (epochs x rows); None when it runs forever."""
        return None if self.spec.num_epochs is None else self.spec.num_epochs * len(self)

    def order(self, epoch: int) -> list[int]:
        """Row indexes in the order epoch `epoch` visits them (the last epoch's order is cached)."""
        if epoch != self._order_epoch:
            order = list(range(len(self)))
            if self.spec.shuffle:
                random.Random(f"miles-dataset:{self.spec.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def locate(self, seq: int) -> PromptRef:
        epoch, offset = divmod(seq, len(self))
        return PromptRef(seq, epoch, self.order(epoch)[offset])

    def seq_of(self, epoch: int, prompt_index: int) -> int:
        """The seq that visits `prompt_index` in `epoch` (for prompts the buffer hands back)."""
        return epoch * len(self) + self.order(epoch).index(prompt_index)

    def prompt(self, prompt_index: int) -> dict[str, Any]:
        """A copy of the row, with `messages` (the prompt as OpenAI messages) added."""
        row = self._rows[prompt_index]
        return {**row, "messages": [dict(message) for message in row["messages"]]}

    def label(self, prompt_index: int) -> Any:
        return self._rows[prompt_index].get(self.spec.label_key)


def load_dataset(spec: DatasetSpec) -> Dataset:
    """Reads the file (all of it, or its first `limit` rows). Raises DatasetError naming the problem."""
    rows = _read_rows(spec)
    if spec.limit is not None:
        rows = rows[: spec.limit]
    return Dataset(spec, rows)
