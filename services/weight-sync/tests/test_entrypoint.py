"""miles-weight-sync starts as a real process and serves the probes every service must serve."""

from pathlib import Path

import pytest

from miles.common.testing.smoke import check_service_entrypoint


@pytest.mark.integration
def test_weightsync_entrypoint_serves_probes(tmp_path: Path) -> None:
    metrics = check_service_entrypoint("miles-weight-sync", "MILES_WEIGHTSYNC_", tmp_path, grpc_service=True)
    assert "# TYPE miles_weightsync_" in metrics
