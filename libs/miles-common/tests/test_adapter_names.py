"""Adapter version names round-trip, and names miles did not write are not taken for versions."""

from __future__ import annotations

import pytest

from miles.common.contracts.adapters import adapter_name, parse_adapter_name


@pytest.mark.parametrize(("job_id", "version"), [("job-a", 0), ("lora_1", 7), ("x", 123456)])
def test_names_round_trip(job_id: str, version: int) -> None:
    assert parse_adapter_name(adapter_name(job_id, version)) == (job_id, version)


@pytest.mark.parametrize("name", ["plain-adapter", "job@", "@3", "job@v3", "job@-1", "job@1.5", "job@٣"])
def test_other_names_are_not_versions(name: str) -> None:
    assert parse_adapter_name(name) is None


def test_bad_parts_are_refused() -> None:
    with pytest.raises(ValueError):
        adapter_name("a@b", 1)
    with pytest.raises(ValueError):
        adapter_name("job", -1)
