"""Datasets: JSONL and Parquet, local or through an fsspec URL, prompts as messages, and the per-epoch
permutation that maps every seq to the same prompt on every worker."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles.common.jobspec.rollout import DatasetSpec
from miles.rollout.dataset import load_dataset
from miles.rollout.errors import DatasetError

ROWS = [{"prompt": f"question {i}", "label": str(i), "extra": i} for i in range(10)]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_jsonl_rows_become_prompts_with_messages(tmp_path: Path) -> None:
    dataset = load_dataset(DatasetSpec(path=write_jsonl(tmp_path / "d.jsonl", ROWS)))
    prompt = dataset.prompt(3)
    assert len(dataset) == 10 and prompt["messages"] == [{"role": "user", "content": "question 3"}]
    assert prompt["extra"] == 3 and dataset.label(3) == "3"
    prompt["messages"].append({"role": "user", "content": "mutated"})
    assert len(dataset.prompt(3)["messages"]) == 1, "prompts are copies"


def test_parquet_and_fsspec_urls_are_read(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": f"q{i}"}], "label": i}
            for i in range(5)]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    parquet = load_dataset(DatasetSpec(path=str(tmp_path / "d.parquet")))
    assert parquet.prompt(4)["messages"][1] == {"role": "user", "content": "q4"} and parquet.label(4) == 4
    with fsspec.open("memory://bucket/prompts.jsonl", "w") as handle:
        handle.write("".join(json.dumps(row) + "\n" for row in ROWS[:3]))
    remote = load_dataset(DatasetSpec(path="memory://bucket/prompts.jsonl"))
    assert len(remote) == 3


def test_limit_keeps_the_first_rows(tmp_path: Path) -> None:
    dataset = load_dataset(DatasetSpec(path=write_jsonl(tmp_path / "d.jsonl", ROWS), limit=4))
    assert len(dataset) == 4 and sorted(dataset.order(0)) == [0, 1, 2, 3]


def test_each_epoch_is_a_seeded_permutation_and_seqs_map_back(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    dataset = load_dataset(DatasetSpec(path=path, seed=7, num_epochs=3))
    again = load_dataset(DatasetSpec(path=path, seed=7, num_epochs=3))
    other_seed = load_dataset(DatasetSpec(path=path, seed=8))
    assert dataset.order(0) == again.order(0) and dataset.order(1) == again.order(1)
    assert sorted(dataset.order(1)) == list(range(10)) and dataset.order(0) != dataset.order(1)
    assert dataset.order(0) != other_seed.order(0)
    assert dataset.num_seqs == 30
    for seq in range(30):
        ref = dataset.locate(seq)
        assert ref.epoch == seq // 10 and dataset.seq_of(ref.epoch, ref.prompt_index) == seq
    unshuffled = load_dataset(DatasetSpec(path=path, shuffle=False))
    assert unshuffled.order(5) == list(range(10))


@pytest.mark.parametrize(
    ("content", "match"),
    [("", "no rows"), ('{"prompt": 3}\n', "prompt"), ("[1, 2]\n", "JSON object"), ("{not json\n", "cannot read")],
)
def test_bad_files_are_refused_with_a_reason(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=match):
        load_dataset(DatasetSpec(path=str(path)))


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(DatasetSpec(path=str(tmp_path / "missing.jsonl")))
