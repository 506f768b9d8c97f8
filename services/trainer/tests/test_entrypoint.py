"""miles-trainer starts as a real process and serves the probes every service must serve."""

from pathlib import Path

import pytest

from miles.common.testing.smoke import check_service_entrypoint


@pytest.mark.integration
def test_trainer_entrypoint_serves_probes(tmp_path: Path) -> None:
    metrics = check_service_entrypoint("miles-trainer", "MILES_TRAINER_", tmp_path, grpc_service=True)
    assert "# TYPE miles_trainer_" in metrics
