"""miles-session-server starts as a real process (with a real Redis) and serves the probes every service must."""

from pathlib import Path

import pytest

from miles.common.testing.smoke import check_service_entrypoint


@pytest.mark.integration
def test_session_entrypoint_serves_probes(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_SESSION_REDIS_URL", redis_url)
    metrics = check_service_entrypoint("miles-session-server", "MILES_SESSION_", tmp_path, grpc_service=False)
    assert "# TYPE miles_session_turns_total counter" in metrics
    assert "miles_session_tito_mismatch_total" in metrics
