"""Fixtures of the weight-sync tests; helpers live in weightsync_testkit.py (this folder is put on sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Qwen3 model (bf16 weights), built by the engine's own builder."""
    from miles.engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3")
