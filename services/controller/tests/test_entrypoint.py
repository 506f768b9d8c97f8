"""miles-controller starts as a real process and serves the probes every service must serve."""

from pathlib import Path

import pytest

from miles.common.testing.smoke import check_service_entrypoint


@pytest.mark.integration
def test_controller_entrypoint_serves_probes(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_CONTROLLER_REDIS_URL", redis_url)  # /readyz checks Redis
    monkeypatch.setenv("MILES_CONTROLLER_STATE_DIR", str(tmp_path / "state"))
    metrics = check_service_entrypoint("miles-controller", "MILES_CONTROLLER_", tmp_path, grpc_service=False)
    assert "# TYPE miles_controller_" in metrics
    assert "miles_controller_supervisor_leader" in metrics
