"""Start a service's console entry point as a real process and check what every service must serve."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from miles.common.spawn import console_script as console_script  # re-exported: tests import it from here
from miles.common.testing.ports import free_port
from miles.common.testing.processes import ServiceProcess


def check_service_entrypoint(script: str, env_prefix: str, log_dir: Path, *, grpc_service: bool) -> str:
    """Start `script` with ports from the environment, check /healthz, /readyz, /metrics (and gRPC health).

    Returns the /metrics text for further checks.
    """
    port, metrics_port = free_port(), free_port()
    http_port = metrics_port if grpc_service else port
    env = {f"{env_prefix}PORT": str(port), f"{env_prefix}METRICS_PORT": str(metrics_port)}
    base = f"http://127.0.0.1:{http_port}"
    with ServiceProcess(
        [console_script(script)], ready_url=f"{base}/readyz", env=env, log_path=log_dir / f"{script}.log"
    ):
        assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
        metrics = httpx.get(f"{base}/metrics")
        assert metrics.status_code == 200
        if grpc_service:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        return metrics.text
