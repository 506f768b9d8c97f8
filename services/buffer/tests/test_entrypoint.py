"""miles-buffer starts as a real process and serves the probes every service must serve."""

from pathlib import Path

import pytest

from miles.common.testing.smoke import check_service_entrypoint


@pytest.mark.integration
def test_buffer_entrypoint_serves_probes(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_BUFFER_REDIS_URL", redis_url)
    metrics = check_service_entrypoint("miles-buffer", "MILES_BUFFER_", tmp_path, grpc_service=True)
    assert "# TYPE miles_buffer_" in metrics
