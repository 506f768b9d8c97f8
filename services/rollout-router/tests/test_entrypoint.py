"""miles-rollout-router starts as a real process, serves the probes every service must serve, and its admin API."""

from pathlib import Path

import grpc
import httpx
import pytest

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import check_service_entrypoint, console_script
from miles.proto.router.v1 import router_pb2, router_pb2_grpc


@pytest.mark.integration
def test_router_entrypoint_serves_probes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_ROUTER_ADMIN_GRPC_PORT", str(free_port()))
    metrics = check_service_entrypoint("miles-rollout-router", "MILES_ROUTER_", tmp_path, grpc_service=False)
    assert "# TYPE miles_router_" in metrics


@pytest.mark.integration
def test_router_entrypoint_serves_admin_api(tmp_path: Path) -> None:
    port, grpc_port = free_port(), free_port()
    env = {"MILES_ROUTER_ADMIN_GRPC_PORT": str(grpc_port), "MILES_ROUTER_STATIC_ENGINES": '{"job": []}'}
    argv = [console_script("miles-rollout-router"), "--port", str(port), "--policy", "cache_aware"]
    base = f"http://127.0.0.1:{port}"
    with ServiceProcess(argv, ready_url=f"{base}/readyz", env=env, log_path=tmp_path / "router.log"):
        stats = httpx.get(f"{base}/admin/v1/stats", params={"pool": "job"}).json()
        assert stats["policy"] == "cache_aware" and stats["num_engines"] == 0
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            listed = router_pb2_grpc.RouterAdminServiceStub(channel).ListEngines(
                router_pb2.ListEnginesRequest(), timeout=10
            )
        assert list(listed.engines) == []
        answer = httpx.post(f"{base}/generate", json={"text": "hi"}, headers={"X-Miles-Pool": "job"})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_routable_engine"
