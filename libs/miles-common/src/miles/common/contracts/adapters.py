"""The name of one LoRA adapter version on a shared engine pool: `<job_id>@<version>`, one spelling everywhere.

A LoRA job on a shared pool publishes adapter versions, not weights. Each version is loaded into every engine
of the pool under its own SGLang `lora_name` (`/load_lora_adapter`), so that versions never change under a
request: a request names exactly the version it is served with (`lora_path`), and the session server records
that version for the turn from the name it sent, whatever the engine reports for its base weights. Names of
different jobs never collide (job ids are unique and contain no `@`), and the engine's cache namespace per
loaded adapter keeps KV apart between jobs and between versions.

The trainer builds the name when it publishes (`adapter_name`); the session server reads the job and version
back (`parse_adapter_name`) when it records a turn.
"""

from __future__ import annotations

SEPARATOR = "@"
VERSIONS_LOADED_PER_JOB = 2
"""Adapter versions a job keeps loaded on each engine by default (the live one and the one before, which requests
sent just before the switch still name): a shared pool of `max_loaded_loras` slots takes that // 2 jobs at once."""


def adapter_name(job_id: str, version: int) -> str:
    """The lora_name of `job_id`'s adapter at `version` (>= 0)."""
    if not job_id or SEPARATOR in job_id:
        raise ValueError(f"a job id for an adapter name must be non-empty and contain no {SEPARATOR!r}: {job_id!r}")
    if version < 0:
        raise ValueError(f"an adapter version is >= 0, got {version}")
    return f"{job_id}{SEPARATOR}{version}"


def parse_adapter_name(name: str) -> tuple[str, int] | None:
    """(job_id, version) of a name written by `adapter_name`; None for any other lora_name."""
    job_id, separator, version = name.rpartition(SEPARATOR)
    if not separator or not job_id or not version.isdigit() or not version.isascii():
        return None
    return job_id, int(version)
