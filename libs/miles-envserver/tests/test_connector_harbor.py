"""The harbor connector in its real interpreter (`.envs/harbor`, harbor==0.25.0 on Python 3.12): a real sandbox
gateway (local bubblewrap backend, with an operator token, so the job's capability is what opens its sandboxes),
an environment server started as the worker starts it, a fake OpenAI chat endpoint in this process answering
each episode's turns from a script, and harbor's own Verifier deciding the reward from the tests of the example
tasks (examples/harbor_tasks)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.auth import job_capability
from miles.common.spawn import ProcessSpec, console_script, spawn, terminate
from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.processes import wait_for_http_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # heavy interpreters: make test-slow

REPO_ROOT = Path(__file__).resolve().parents[3]
ENV_PYTHON = REPO_ROOT / ".envs" / "harbor" / "bin" / "python"
TASKS_DIR = REPO_ROOT / "examples" / "harbor_tasks"
TASK_NAMES = ["fizzbuzz", "hello-file", "line-count"]
JOB_ID = "harbor-test"
OPERATOR_TOKEN = "harbor-test-operator-token-0123456789abcdef"
ARGS = {"tasks_dir": str(TASKS_DIR), "max_turns": 4, "command_timeout_s": 20}


def env_python() -> Path:
    """Harbor's interpreter; its absence fails (not skips) the test: it is part of `make setup`."""
    if not ENV_PYTHON.exists():
        pytest.fail(f"{ENV_PYTHON} is missing: run `make env-harbor` (make setup builds it)")
    return ENV_PYTHON


@dataclass
class FakeChat:
    """An OpenAI chat-completions endpoint: answers each call with the next reply scripted for its API key."""

    url: str
    replies: dict[str, list[str]] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture(scope="module")
def fake_chat() -> Iterator[FakeChat]:
    chat = FakeChat(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            api_key = self.headers.get("Authorization", "").removeprefix("Bearer ")
            chat.requests.append({"api_key": api_key, "body": body})
            script = chat.replies[api_key]
            content = script.pop(0) if script else "<done/>"
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
            data = json.dumps({"id": "x", "object": "chat.completion", "choices": [choice]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    chat.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield chat
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real miles-sandbox-gateway (local backend) that needs a token: the job's capability opens its sandboxes."""
    directory = tmp_path_factory.mktemp("gateway")
    port, http_port = free_port(), free_port()
    env = {
        "MILES_SANDBOX_PORT": str(port),
        "MILES_SANDBOX_METRICS_PORT": str(http_port),
        "MILES_SANDBOX_STATE_DIR": str(directory / "state"),
        "MILES_SANDBOX_OPERATOR_TOKEN": OPERATOR_TOKEN,
        "MILES_SANDBOX_WARM_POOL_SIZE": "0",
    }
    url = f"http://127.0.0.1:{http_port}"
    process = ServiceProcess(
        [console_script("miles-sandbox-gateway")], ready_url=f"{url}/readyz", env=env, log_path=directory / "log"
    )
    with process:
        yield url


def server_argv(args: dict[str, Any], port_file: Path) -> list[str]:
    return [
        *(str(env_python()), "-m", "miles.envserver", "--connector", "harbor"),
        *("--args", json.dumps(args), "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)),
    ]


@pytest.fixture(scope="module")
def env_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, url = start_server(ARGS, tmp_path_factory.mktemp("harbor"))
    yield url
    terminate(process, grace_s=5)


def row_of(env_url: str, task: str) -> dict[str, Any]:
    rows: list[dict[str, Any]] = httpx.get(f"{env_url}/v1/rows", timeout=10).json()["rows"]
    return next(row for row in rows if row["info"]["task"] == task)


def episode(env_url: str, chat: FakeChat, gateway_url: str, task: str, replies: list[str], **metadata: Any) -> Any:
    """POST one episode of `task` whose model calls are answered with `replies` in turn; returns the response."""
    api_key = f"key-{len(chat.requests)}-{task}-{len(chat.replies)}"
    chat.replies[api_key] = list(replies)
    request = {
        "base_url": chat.url,
        "api_key": api_key,
        "row_index": TASK_NAMES.index(task),
        "row": row_of(env_url, task),
        "request_kwargs": {"temperature": 0.5},
        "metadata": {
            "job_id": JOB_ID,
            "episode_id": api_key,
            "sandbox_url": gateway_url,
            "sandbox_token": job_capability(OPERATOR_TOKEN, "sandbox", JOB_ID),
            **metadata,
        },
    }
    return httpx.post(f"{env_url}/v1/episodes", json=request, timeout=120)


def result_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def live_sandboxes(gateway_url: str) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    listed = httpx.get(f"{gateway_url}/v1/sandboxes", params={"job_id": JOB_ID}, headers=headers, timeout=10)
    sandboxes: list[dict[str, Any]] = listed.json()["sandboxes"]
    return sandboxes


def test_example_tasks_pass_harbors_own_task_loader() -> None:
    code = (
        "import sys; from pathlib import Path; from harbor.models.task.task import Task\n"
        "for toml in sorted(Path(sys.argv[1]).glob('*/task.toml')):\n"
        "    print(toml.parent.name, Task.is_valid_dir(toml.parent), Task(toml.parent).name)"
    )
    done = subprocess.run([str(env_python()), "-c", code, str(TASKS_DIR)], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [f"{name} True {name}" for name in TASK_NAMES]


def test_rows_are_the_tasks_instructions_in_name_order(env_url: str) -> None:
    info = httpx.get(f"{env_url}/v1/info", timeout=10).json()
    assert (info["connector"], info["environment"], info["num_rows"]) == ("harbor", "harbor_tasks", 3)
    rows = httpx.get(f"{env_url}/v1/rows", timeout=10).json()["rows"]
    assert [row["info"]["task"] for row in rows] == TASK_NAMES
    system, user = rows[1]["prompt"]
    assert "<command>" in system["content"] and "<done/>" in system["content"]
    assert user == {"role": "user", "content": (TASKS_DIR / "hello-file" / "instruction.md").read_text()}
    assert rows[1]["info"]["task_dir"] == str(TASKS_DIR / "hello-file")


def test_right_commands_score_one_by_harbors_verifier(env_url: str, fake_chat: FakeChat, gateway_url: str) -> None:
    replies = [
        "<command>echo 'Hello, Harbor!' > /app/hello.txt</command>",
        "<command>cat hello.txt</command>",
        "<done/>",
    ]
    result = result_of(episode(env_url, fake_chat, gateway_url, "hello-file", replies))
    assert result["reward"] == 1.0
    assert result["reward_info"] == {"reward": 1.0}
    metadata = result["metadata"]
    assert (metadata["num_turns"], metadata["num_commands"], metadata["done"]) == (3, 2, True)
    assert metadata["command_exit_codes"] == [0, 0]
    assert "hello.txt is right" in metadata["test_output"]  # test.sh's output, as harbor's verifier saved it
    # The model read each command's output: the third call saw what `cat hello.txt` printed.
    third_call = fake_chat.requests[-1]["body"]
    assert third_call["messages"][-1] == {"role": "user", "content": "Exit code: 0\nOutput:\nHello, Harbor!\n"}
    assert third_call["temperature"] == 0.5
    assert live_sandboxes(gateway_url) == []


def test_wrong_commands_score_zero(env_url: str, fake_chat: FakeChat, gateway_url: str) -> None:
    replies = ["<command>echo 'hello harbor' > /app/hello.txt</command>", "<done/>"]
    result = result_of(episode(env_url, fake_chat, gateway_url, "hello-file", replies))
    assert (result["reward"], result["reward_info"]) == (0.0, {"reward": 0.0})
    assert "missing or wrong" in result["metadata"]["test_output"]


def test_a_model_that_never_finishes_stops_at_max_turns_and_is_still_verified(
    env_url: str, fake_chat: FakeChat, gateway_url: str
) -> None:
    replies = ["I will think.", "<command>ls /nope</command>", "<command>true</command>", "<command>true</command>"]
    result = result_of(episode(env_url, fake_chat, gateway_url, "hello-file", replies))
    assert result["reward"] == 0.0
    metadata = result["metadata"]
    assert (metadata["num_turns"], metadata["done"], metadata["command_exit_codes"]) == (4, False, [2, 0, 0])
    second_call = fake_chat.requests[-3]["body"]["messages"]
    assert second_call[-1]["content"].startswith("Could not parse a command")


def test_dockerfile_copy_sets_the_environment_up(env_url: str, fake_chat: FakeChat, gateway_url: str) -> None:
    # line-count's Dockerfile COPYs words.txt into /app: the command only works if the setup did.
    replies = ["<command>grep -c a /app/words.txt > /app/count.txt</command><done/>"]
    result = result_of(episode(env_url, fake_chat, gateway_url, "line-count", replies))
    assert result["reward"] == 1.0
    assert result["metadata"]["num_turns"] == 1


def test_partial_credit_from_reward_json(env_url: str, fake_chat: FakeChat, gateway_url: str) -> None:
    # Printing every number gets the 8 lines that are neither Fizz nor Buzz right: the test writes reward.json.
    program = "for n in range(1, 16): print(n)"
    replies = [
        f"<command>printf '%s\\n' '{program}' > fizzbuzz.py && python3 fizzbuzz.py | tail -1</command>",
        "<done/>",
    ]
    result = result_of(episode(env_url, fake_chat, gateway_url, "fizzbuzz", replies))
    assert result["reward"] == pytest.approx(8 / 15)
    assert result["reward_info"] == {"reward": pytest.approx(8 / 15), "lines_right": 8.0}
    assert "8 of 15 lines right" in result["metadata"]["test_output"]


def test_an_episode_without_a_sandbox_fails_naming_sandbox_url(env_url: str, fake_chat: FakeChat) -> None:
    response = episode(env_url, fake_chat, "", "hello-file", ["<done/>"])
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "environment_error"
    assert "sandbox_url" in response.json()["error"]["message"]


def test_a_wrong_capability_is_refused_by_the_gateway(env_url: str, fake_chat: FakeChat, gateway_url: str) -> None:
    response = episode(env_url, fake_chat, gateway_url, "hello-file", ["<done/>"], sandbox_token="not-the-job's")
    assert response.status_code == 500
    assert "403" in response.json()["error"]["message"]


def make_task(root: Path, name: str, *, test_sh: str, environment_files: dict[str, str] | None = None) -> None:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "task.toml").write_text('schema_version = "1.4"\n[verifier]\ntimeout_sec = 30.0\n')
    (task / "instruction.md").write_text("Do nothing.\n")
    (task / "tests" / "test.sh").write_text(f"#!/bin/bash\n{test_sh}\n")
    for filename, text in (environment_files or {}).items():
        (task / "environment" / filename).write_text(text)


def start_server(args: dict[str, Any], directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file, log = directory / "port", directory / "server.log"
    process = spawn(ProcessSpec(argv=tuple(server_argv(args, port_file)), log_path=log, die_with_parent=True))
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            terminate(process, grace_s=5)
            raise RuntimeError(f"the server wrote no port file: {log.read_text(errors='replace')}")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port_file.read_text()}"
    wait_for_http_ready(f"{url}/healthz", timeout_s=60, process=process)
    return process, url


def test_a_malformed_or_missing_reward_fails_the_episode_and_frees_the_sandbox(
    tmp_path: Path, fake_chat: FakeChat, gateway_url: str
) -> None:
    make_task(tmp_path / "tasks", "garbled", test_sh="echo 'one point' > /logs/verifier/reward.txt")
    make_task(tmp_path / "tasks", "silent", test_sh="echo 'wrote no reward'")
    process, url = start_server({"tasks_dir": str(tmp_path / "tasks")}, tmp_path)
    try:
        expected = {"garbled": "VerifierOutputParseError", "silent": "RewardFileNotFoundError"}
        for task, error in expected.items():
            chat_key = f"broken-{task}"
            fake_chat.replies[chat_key] = ["<done/>"]
            row = next(
                row for row in httpx.get(f"{url}/v1/rows", timeout=10).json()["rows"] if row["info"]["task"] == task
            )
            metadata = {"job_id": JOB_ID, "sandbox_url": gateway_url}
            metadata["sandbox_token"] = job_capability(OPERATOR_TOKEN, "sandbox", JOB_ID)
            request = {"base_url": fake_chat.url, "api_key": chat_key, "row_index": 0, "row": row, "metadata": metadata}
            response = httpx.post(f"{url}/v1/episodes", json=request, timeout=120)
            assert response.status_code == 500, response.text
            assert error in response.json()["error"]["message"]
            assert live_sandboxes(gateway_url) == []
    finally:
        terminate(process, grace_s=5)


def test_bad_args_stop_the_server_before_it_listens(tmp_path: Path) -> None:
    args = {"dataset": "terminal-bench@2.0"}
    done = subprocess.run(server_argv(args, tmp_path / "port"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "ConnectorArgsError: dataset: Harbor registry datasets are downloaded from the internet" in done.stderr
    assert not (tmp_path / "port").exists()


CREATE_EACH = """
import json, sys
from miles.envserver.base import ConnectorArgsError
from miles.envserver.connectors.harbor import create
for args in json.loads(sys.argv[1]):
    try:
        create(args)
        print(json.dumps("accepted"))
    except ConnectorArgsError as exc:
        print(json.dumps(str(exc)))
"""


def test_bad_args_and_unsupported_tasks_are_named(tmp_path: Path) -> None:
    compose = {"docker-compose.yaml": "services: {main: {build: .}}\n"}
    make_task(tmp_path / "compose", "compose", test_sh="true", environment_files=compose)
    stages = {"Dockerfile": "FROM python:3.12 AS build\nRUN true\nFROM python:3.12-slim\n"}
    make_task(tmp_path / "stages", "stages", test_sh="true", environment_files=stages)
    onbuild = {"Dockerfile": "FROM python:3.12-slim\nONBUILD RUN true\n"}
    make_task(tmp_path / "onbuild", "onbuild", test_sh="true", environment_files=onbuild)
    cases = [
        ({"tasks_dir": str(TASKS_DIR)}, ["accepted"]),
        ({"tasks_dir": str(TASKS_DIR / "hello-file")}, ["accepted"]),  # one task folder
        ({}, ["tasks_dir is required"]),
        ({"tasks_dir": str(tmp_path / "none")}, ["is not a directory"]),
        ({"tasks_dir": str(tmp_path)}, ["holds no Harbor task"]),
        ({"tasks_dir": str(TASKS_DIR), "max_turns": 0}, ["max_turns must be an integer"]),
        ({"tasks_dir": str(TASKS_DIR), "command_timeout_s": "5"}, ["command_timeout_s must be a number"]),
        ({"tasks_dir": str(TASKS_DIR), "tasks": ["nope"]}, ["tasks ['nope'] are not in tasks_dir"]),
        ({"tasks_dir": str(TASKS_DIR), "agent": "terminus-2"}, ["unknown args ['agent']"]),
        ({"tasks_dir": str(tmp_path / "compose")}, ["compose: docker-compose environment"]),
        ({"tasks_dir": str(tmp_path / "stages")}, ["stages: multi-stage Dockerfile"]),
        ({"tasks_dir": str(tmp_path / "onbuild")}, ["onbuild: Dockerfile instruction ONBUILD"]),
    ]
    argv = [str(env_python()), "-c", CREATE_EACH, json.dumps([args for args, _ in cases])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    messages = [json.loads(line) for line in done.stdout.splitlines()]
    for (args, expected), message in zip(cases, messages, strict=True):
        for text in expected:
            assert text in message, (args, message)
