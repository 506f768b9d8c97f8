"""miles-engine starts as a real process and serves the probes every service must serve."""

from pathlib import Path

import pytest

from miles.common.testing.smoke import check_service_entrypoint


@pytest.mark.integration
def test_engine_entrypoint_serves_probes(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_ENGINE_MODEL_PATH", str(tiny_model_dir))
    monkeypatch.setenv("MILES_ENGINE_FAKE_MODEL", "true")
    metrics = check_service_entrypoint("miles-engine", "MILES_ENGINE_", tmp_path, grpc_service=False)
    assert "# TYPE miles_engine_" in metrics
    assert "# TYPE sglang:num_running_reqs gauge" in metrics
