"""The reasoning_gym connector in its real interpreter (`.envs/reasoning-gym`, reasoning-gym==0.1.25): an
environment server started as the worker starts it, a fake OpenAI chat endpoint in this process answering what
each test chooses, and the dataset's own scorer deciding the reward."""

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

from miles.common.spawn import ProcessSpec, spawn, terminate
from miles.common.testing.processes import wait_for_http_ready

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[3]
ENV_PYTHON = REPO_ROOT / ".envs" / "reasoning-gym" / "bin" / "python"
ARGS = {"dataset": "chain_sum", "size": 8, "seed": 3, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 2}}
DEFAULT_SYSTEM_PROMPT_START = "Given a problem, your task is to answer the question by thinking step-by-step"
"""The first words of reasoning_gym.utils.SYSTEM_PROMPTS["default"] (the connector's default system prompt)."""


def env_python() -> Path:
    """The reasoning-gym interpreter; its absence fails (not skips) the test: it is part of `make setup`."""
    if not ENV_PYTHON.exists():
        pytest.fail(f"{ENV_PYTHON} is missing: run `make env-reasoning-gym` (make setup builds it)")
    return ENV_PYTHON


@dataclass
class FakeChat:
    """An OpenAI chat-completions endpoint: answers each request with the reply registered for its API key."""

    url: str
    replies: dict[str, str] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture(scope="module")
def fake_chat() -> Iterator[FakeChat]:
    chat = FakeChat(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            api_key = self.headers.get("Authorization", "").removeprefix("Bearer ")
            chat.requests.append({"path": self.path, "api_key": api_key, "body": body})
            message = {"role": "assistant", "content": chat.replies[api_key]}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            answer = {"id": "x", "object": "chat.completion", "choices": [choice]}
            data = json.dumps(answer).encode()
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


def server_argv(args: dict[str, Any], port_file: Path) -> list[str]:
    return [
        *(str(env_python()), "-m", "miles.envserver", "--connector", "reasoning_gym"),
        *("--args", json.dumps(args), "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)),
    ]


@pytest.fixture(scope="module")
def env_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A reasoning_gym environment server on chain_sum (two terms of up to two digits: quick to generate)."""
    directory = tmp_path_factory.mktemp("reasoning-gym")
    port_file, log = directory / "port", directory / "server.log"
    process = spawn(ProcessSpec(argv=tuple(server_argv(ARGS, port_file)), log_path=log, die_with_parent=True))
    try:
        wait_for_port_file(port_file, process)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        wait_for_http_ready(f"{url}/healthz", timeout_s=60, process=process)
        yield url
    except Exception:
        print(log.read_text(errors="replace"))
        raise
    finally:
        terminate(process, grace_s=5)


def wait_for_port_file(port_file: Path, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the environment server wrote no port file (exit {process.poll()})")
        time.sleep(0.05)


def rows(env_url: str) -> list[dict[str, Any]]:
    body = httpx.get(f"{env_url}/v1/rows", timeout=10).json()
    assert body["total"] == ARGS["size"]
    result: list[dict[str, Any]] = body["rows"]
    return result


def run_episode(env_url: str, chat: FakeChat, index: int, reply: str) -> dict[str, Any]:
    """One episode of row `index` whose single model call is answered with `reply`; returns the result JSON."""
    api_key = f"key-{len(chat.requests)}-{index}"
    chat.replies[api_key] = reply
    request = {
        "base_url": chat.url,
        "api_key": api_key,
        "row_index": index,
        "row": rows(env_url)[index],
        "request_kwargs": {"temperature": 0.7, "max_tokens": 64},
        "metadata": {"episode_id": "e"},
    }
    response = httpx.post(f"{env_url}/v1/episodes", json=request, timeout=30)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_rows_are_the_dataset_questions_under_the_default_system_prompt(env_url: str) -> None:
    info = httpx.get(f"{env_url}/v1/info", timeout=10).json()
    assert (info["connector"], info["environment"], info["num_rows"]) == ("reasoning_gym", "chain_sum", 8)
    for index, row in enumerate(rows(env_url)):
        system, user = row["prompt"]
        assert system["role"] == "system" and system["content"].startswith(DEFAULT_SYSTEM_PROMPT_START)
        assert user["role"] == "user" and user["content"].endswith("=")  # "... arithmetic problem: 12 + 7 ="
        assert row["info"] == {"index": index, "dataset": "chain_sum"}
        int(row["label"])  # chain_sum's answers are integers


def test_right_answer_scores_one_by_the_datasets_own_scorer(env_url: str, fake_chat: FakeChat) -> None:
    label = rows(env_url)[0]["label"]
    result = run_episode(env_url, fake_chat, 0, f"<think>adding</think>\n<answer>{label}</answer>")
    assert result["reward"] == 1.0
    assert result["reward_info"] == {"score": 1.0, "answer_found": True, "answer": label}
    assert result["metadata"]["index"] == 0
    # chain_sum's scorer (compute_decimal_reward) tolerates a sign, leading zeros and trailing decimals:
    # a string comparison of our own would give 0 here.
    padded = label if label.startswith("-") else f"+0{label}.00"
    assert run_episode(env_url, fake_chat, 0, f"<answer>{padded}</answer>")["reward"] == 1.0


def test_wrong_or_missing_answer_scores_zero(env_url: str, fake_chat: FakeChat) -> None:
    label = int(rows(env_url)[1]["label"])
    wrong = run_episode(env_url, fake_chat, 1, f"<answer>{label + 1}</answer>")
    assert (wrong["reward"], wrong["reward_info"]["answer_found"]) == (0.0, True)
    untagged = run_episode(env_url, fake_chat, 1, f"The answer is {label}.")  # no <answer> tags: none extracted
    assert untagged["reward"] == 0.0
    assert untagged["reward_info"] == {"score": 0.0, "answer_found": False, "answer": None}


def test_model_call_goes_to_the_session_endpoint_with_the_rows_prompt_and_sampling_kwargs(
    env_url: str, fake_chat: FakeChat
) -> None:
    row = rows(env_url)[2]
    run_episode(env_url, fake_chat, 2, "<answer>0</answer>")
    call = fake_chat.requests[-1]
    assert call["path"] == "/v1/chat/completions" and call["api_key"].startswith("key-")
    assert call["body"]["messages"] == row["prompt"]
    assert (call["body"]["temperature"], call["body"]["max_tokens"]) == (0.7, 64)


def test_bad_args_stop_the_server_before_it_listens_naming_the_field(tmp_path: Path) -> None:
    args = {"dataset": "no_such_dataset"}
    done = subprocess.run(server_argv(args, tmp_path / "port"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "ConnectorArgsError: dataset must be a reasoning-gym dataset name" in done.stderr
    assert "basic_arithmetic" in done.stderr  # it lists valid names
    assert not (tmp_path / "port").exists()


CREATE_EACH = """
import json, sys
from miles.envserver.base import ConnectorArgsError
from miles.envserver.connectors.reasoning_gym import create
for args in json.loads(sys.argv[1]):
    try:
        create(args)
        print(json.dumps("accepted"))
    except ConnectorArgsError as exc:
        print(json.dumps(str(exc)))
"""


def test_bad_args_errors_name_the_field() -> None:
    cases = [
        ({"dataset": "chain_sum", "config": {"max_term": 2}}, ["config.max_term", "max_terms"]),
        ({"dataset": "chain_sum", "config": {"min_terms": 3, "max_terms": 2}}, ["config:", "max_terms"]),
        ({"dataset": "chain_sum", "config": {"seed": 1}}, ["config.seed", "`seed` argument"]),
        ({"dataset": "chain_sum", "size": 0}, ["size must be an integer"]),
        ({"dataset": "chain_sum", "prompt": "x"}, ["unknown args ['prompt']"]),
        ({"size": 4}, ["dataset is required"]),
        ({"dataset": "composite", "config": {"datasets": [{"name": "nope", "weight": 1}]}}, ["datasets[0].name"]),
        ({"dataset": "chain_sum", "system_prompt": 3}, ["system_prompt must be a string"]),
    ]
    argv = [str(env_python()), "-c", CREATE_EACH, json.dumps([args for args, _ in cases])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    messages = [json.loads(line) for line in done.stdout.splitlines()]
    for (args, expected), message in zip(cases, messages, strict=True):
        for text in expected:
            assert text in message, (args, message)
