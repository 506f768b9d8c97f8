"""miles-rollout-router starts as a real process and serves the probes every service must serve."""

from pathlib import Path

import pytest

from miles.common.testing.smoke import check_service_entrypoint


@pytest.mark.integration
def test_router_entrypoint_serves_probes(tmp_path: Path) -> None:
    metrics = check_service_entrypoint("miles-rollout-router", "MILES_ROUTER_", tmp_path, grpc_service=False)
    assert "# TYPE miles_router_" in metrics
