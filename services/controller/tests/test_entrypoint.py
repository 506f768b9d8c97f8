"""miles-controller starts as a real process and serves the probes every service must serve."""

from pathlib import Path

import pytest

from miles.common.testing.smoke import check_service_entrypoint


@pytest.mark.integration
def test_controller_entrypoint_serves_probes(tmp_path: Path) -> None:
    metrics = check_service_entrypoint("miles-controller", "MILES_CONTROLLER_", tmp_path, grpc_service=False)
    assert "# TYPE miles_controller_" in metrics
