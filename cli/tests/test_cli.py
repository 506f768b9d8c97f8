"""The `miles` CLI against a scripted test controller (a stdlib HTTP server speaking the job API's JSON and SSE).

What is pinned: YAML specs are posted as JSON; `submit` follows the event stream to the end, shows the reward per
step and exits 0 only for SUCCEEDED; the SSE parser handles comments, retry lines and multi-line data; `jobs`,
`cancel` and `logs` work; an API error is printed with its status and exits 1. The real platform (`miles up` /
`down`) is exercised in test_controller_cli_platform.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from miles.cli.follow import JobWatch, SseEvent, parse_sse_lines
from miles.cli.main import app

SPEC_YAML = """
name: cli-test
model: {path: /models/tiny}
rollout:
  dataset: {path: examples/calculator_tool/data.jsonl}
  agent: {function: calculator_tool.agent:agent, python_path: [examples]}
train: {num_steps: 3}
"""


def _job(job_id: str, state: str, step: int = 0, reward: float | None = None) -> dict[str, Any]:
    return {"job_id": job_id, "name": "cli-test", "state": state, "step": step, "num_steps": 3, "reward": reward,
            "staleness": 0.5, "prefix_hit_rate": 0.9, "tito_mismatches": 0}  # fmt: skip


def _progress(step: int, reward: float) -> tuple[str, dict[str, Any]]:
    metrics = {"reward_mean": reward, "staleness_mean": 0.5, "tokens_per_second": 1000.0, "prefix_hit_rate": 0.9}
    return "progress", {"phase": "running", "step": step, "num_steps": 3, "weight_version": step, "metrics": metrics}


class ScriptedController:
    """Job API double: records what it received; the event stream is the script given per test."""

    def __init__(self, final_state: str) -> None:
        self.received: list[tuple[str, str, Any]] = []
        self.final_state = final_state
        self.events = [
            ("state", {"state": "PENDING"}),
            _progress(1, 0.1),
            _progress(2, 0.4),
            _progress(3, 0.8),
            ("state", {"state": final_state, "reason": "finished 3 steps"}),
        ]

    def handler(self) -> type[BaseHTTPRequestHandler]:
        controller = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                controller.received.append(("POST", self.path, body))
                if self.path == "/v1/jobs":
                    if body["name"] == "bad":
                        self._reply(422, {"detail": [{"loc": ["body", "train"], "msg": "num_steps must be >= 1"}]})
                    else:
                        self._reply(201, _job("job-1", "PENDING"))
                elif self.path.endswith("/cancel"):
                    self._reply(200, _job("job-1", "CANCELLED"))

            def do_GET(self) -> None:
                controller.received.append(("GET", self.path, None))
                if self.path == "/v1/jobs" or self.path.startswith("/v1/jobs?"):
                    self._reply(200, {"jobs": [_job("job-1", controller.final_state, 3, 0.8)]})
                elif self.path.endswith("/events"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.end_headers()
                    self.wfile.write(b"retry: 2000\n\n: keep-alive\n\n")
                    for index, (kind, data) in enumerate(controller.events):
                        self.wfile.write(f"id: 1-{index}\nevent: {kind}\ndata: {json.dumps(data)}\n\n".encode())
                        self.wfile.flush()
                else:
                    self._reply(200, _job("job-1", controller.final_state, 3, 0.8))

        return Handler


@pytest.fixture
def controller(request: pytest.FixtureRequest) -> Iterator[tuple[ScriptedController, str]]:
    scripted = ScriptedController(getattr(request, "param", "SUCCEEDED"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), scripted.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield scripted, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(SPEC_YAML)
    return path


def test_submit_posts_the_yaml_spec_as_json_and_follows_to_success(
    controller: tuple[ScriptedController, str], spec_file: Path
) -> None:
    scripted, url = controller
    result = CliRunner().invoke(app, ["submit", str(spec_file), "--url", url])
    assert result.exit_code == 0, result.output
    method, path, body = scripted.received[0]
    assert (method, path) == ("POST", "/v1/jobs")
    assert body["model"] == {"path": "/models/tiny"} and body["train"] == {"num_steps": 3}
    assert "submitted job job-1" in result.output
    assert "reward per step" in result.output and "0.800" in result.output and "0.100" in result.output
    assert "SUCCEEDED" in result.output


@pytest.mark.parametrize("controller", ["FAILED"], indirect=True)
def test_submit_exits_1_when_the_job_fails(controller: tuple[ScriptedController, str], spec_file: Path) -> None:
    _, url = controller
    result = CliRunner().invoke(app, ["submit", str(spec_file), "--url", url])
    assert result.exit_code == 1
    assert "FAILED" in result.output


def test_submit_prints_a_validation_error_and_exits_1(
    controller: tuple[ScriptedController, str], spec_file: Path
) -> None:
    _, url = controller
    result = CliRunner().invoke(app, ["submit", str(spec_file), "--url", url, "--name", "bad", "--no-follow"])
    assert result.exit_code == 1
    assert "422" in result.output and "num_steps must be >= 1" in result.output


def test_jobs_and_cancel(controller: tuple[ScriptedController, str]) -> None:
    scripted, url = controller
    listed = CliRunner().invoke(app, ["jobs", "--url", url, "--json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.output)[0]["job_id"] == "job-1"
    cancelled = CliRunner().invoke(app, ["cancel", "job-1", "--url", url])
    assert cancelled.exit_code == 0 and "CANCELLED" in cancelled.output
    assert ("POST", "/v1/jobs/job-1/cancel", None) in scripted.received


def test_sse_parser_skips_comments_and_joins_multiline_data() -> None:
    lines = ["retry: 2000", "", ": keep-alive", "", "id: 5-0", "event: progress", 'data: {"step":', "data: 2}", ""]
    events = list(parse_sse_lines(iter(lines)))
    assert events == [SseEvent("5-0", "progress", {"step": 2})]


def test_job_watch_keeps_the_reward_of_every_step_it_saw() -> None:
    watch = JobWatch("job-1")
    for kind, data in [_progress(1, 0.25), _progress(1, 0.25), _progress(3, 0.75)]:
        watch.apply(SseEvent("x", kind, data))
    watch.apply(SseEvent("y", "state", {"state": "SUCCEEDED"}))
    assert watch.rewards_by_step == {1: 0.25, 3: 0.75}
    assert watch.ended and watch.num_steps == 3


def test_logs_prints_the_tail_of_a_service_and_of_a_job_process(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "router.log").write_text("".join(f"line {i}\n" for i in range(100)))
    job_dir = tmp_path / "controller" / "jobs" / "job-9"
    job_dir.mkdir(parents=True)
    (job_dir / "trainer.log").write_text("step 1\nstep 2\n")
    service = CliRunner().invoke(app, ["logs", "router", "--home", str(tmp_path), "-n", "2"])
    assert service.exit_code == 0 and service.output.splitlines() == ["line 98", "line 99"]
    listing = CliRunner().invoke(app, ["logs", "job-9", "--home", str(tmp_path)])
    assert "trainer.log" in listing.output
    process = CliRunner().invoke(app, ["logs", "job-9", "trainer", "--home", str(tmp_path)])
    assert process.output.splitlines() == ["step 1", "step 2"]
    missing = CliRunner().invoke(app, ["logs", "nothing", "--home", str(tmp_path)])
    assert missing.exit_code != 0
