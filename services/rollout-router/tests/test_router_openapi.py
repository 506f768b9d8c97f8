"""The router's published OpenAPI matches what it answers: a bounded schemathesis run over every operation.

A real `miles-rollout-router` process in front of a real `miles-engine --fake-model` process (the router holds the
engine's api key, the fuzzer the router's admin token). Every operation gets generated requests, positive and
negative, mostly with the admin token; every answer must be a documented status with a documented media type and
a body as documented, never a hang, and no 5xx but one designed answer, the 503 for a pool the router does not
know (`not_a_server_error_but_unknown_pools`; the run is miles.common.testing.openapi_fuzz's). The data plane runs
first and reaches the engine (its answers come back through the router); the admin operations then register, drain
and deregister engines that mostly do not exist, and the test checks at the end that the router still routes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.checks import CheckContext, not_a_server_error
from schemathesis.core.transport import Response

from miles.common.auth import MIN_TOKEN_CHARS
from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.openapi_fuzz import CHECKS, fuzz_openapi
from miles.common.testing.openapi_fuzz import seed_only_generation as fuzz_seed_only
from miles.common.testing.smoke import console_script

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "a" * MIN_TOKEN_CHARS
ENGINE_KEY = "e" * MIN_TOKEN_CHARS
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_EXAMPLES_PER_OPERATION = 30
POOLS = ("", "default")
"""The pools the router knows: the default one, named or not."""


def not_a_server_error_but_unknown_pools(
    ctx: CheckContext, response: Response, case: schemathesis.Case[Any]
) -> bool | None:
    """not_a_server_error, less one documented answer: 503 `no_routable_engine` naming the X-Miles-Pool the request
    gave when the router knows no such pool. That 503 is the design (a job's pool appears once its engines are
    discovered, so callers retry), and a generated header names a pool that does not exist almost every time;
    every other 5xx still fails, and the answer is still checked against the document by the other checks."""
    pool = next((value for name, value in (case.headers or {}).items() if name.lower() == "x-miles-pool"), "")
    if response.status_code == 503 and pool.strip() not in POOLS:
        try:
            error = json.loads(response.content)["error"]
        except (ValueError, KeyError, TypeError):
            error = {}
        if error.get("code") == "no_routable_engine" and error.get("details", {}).get("pool") == pool.strip():
            return None
    return not_a_server_error(ctx, response, case)


ROUTER_CHECKS = tuple(not_a_server_error_but_unknown_pools if c is not_a_server_error else c for c in CHECKS)


def write_fake_model_dir(out: Path) -> Path:
    """The tiny Qwen3 config and the real Qwen3 tokenizer: all that `--fake-model` reads (no weights, no torch)."""
    from miles.engine.tiny_model import TINY_QWEN3_CONFIG, TOKENIZER_FILES, qwen3_tokenizer_dir

    (out / "config.json").write_text(json.dumps(TINY_QWEN3_CONFIG))
    for name in TOKENIZER_FILES:
        shutil.copyfile(qwen3_tokenizer_dir() / name, out / name)
    return out


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(router URL, engine URL, the router's OpenAPI document): a router process in front of an engine process."""
    logs = tmp_path_factory.mktemp("logs")
    engine_port, router_port = free_port(), free_port()
    engine_url, router_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{router_port}"
    engine_argv = [
        console_script("miles-engine"),
        *("--model-path", str(write_fake_model_dir(tmp_path_factory.mktemp("fake-model")))),
        *("--port", str(engine_port), "--fake-model", "--api-key", ENGINE_KEY, "--weight-version", "0"),
        # Bounded work per request (at most 8 sequences of at most 512 tokens), well within the fuzzer's timeout.
        *("--context-length", "512", "--max-running-requests", "8"),
    ]
    env = {
        "MILES_ROUTER_PORT": str(router_port),
        "MILES_ROUTER_ADMIN_GRPC_PORT": "-1",
        "MILES_ROUTER_ENGINE_URLS": json.dumps([engine_url]),
        "MILES_ROUTER_ADMIN_TOKEN": ADMIN_TOKEN,
        "MILES_ROUTER_ENGINE_API_KEY": ENGINE_KEY,
        "MILES_ROUTER_HEALTH_CHECK_TIMEOUT_S": "2",
        "MILES_ROUTER_RETRY_BACKOFF_INITIAL_S": "0.01",
        "MILES_ROUTER_RETRY_BACKOFF_MAX_S": "0.05",
        "MILES_ROUTER_LOG_JSON": "false",
    }
    with (
        ServiceProcess(engine_argv, ready_url=f"{engine_url}/readyz", log_path=logs / "engine.log"),
        ServiceProcess(
            [console_script("miles-rollout-router")],
            ready_url=f"{router_url}/readyz",
            env=env,
            log_path=logs / "router.log",
        ),
    ):
        yield router_url, engine_url, httpx.get(f"{router_url}/openapi.json").json()


@pytest.fixture
def seed_only_generation() -> Iterator[None]:
    """Requests that depend on the seed only (see openapi_fuzz.seed_only_generation)."""
    with fuzz_seed_only():
        yield


def test_openapi_states_what_the_data_plane_passes_through(router: tuple[str, str, dict[str, Any]]) -> None:
    _, _, document = router
    generate = document["paths"]["/generate"]["post"]
    assert set(generate["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "404", "409", "429", "503", "5XX"} <= set(generate["responses"])
    assert generate["requestBody"]["required"] is True
    assert {p["name"] for p in generate["parameters"]} == {
        "X-Miles-Pool",
        "X-SMG-Routing-Key",
        "X-Miles-Min-Weight-Version",
    }
    for path, operation in [("/admin/v1/engines", "post"), ("/admin/v1/stats", "get")]:
        assert {"401", "403"} <= set(document["paths"][path][operation]["responses"])


def test_every_answer_is_documented(router: tuple[str, str, dict[str, Any]], seed_only_generation: None) -> None:
    router_url, engine_url, document = router
    assert not_a_server_error_but_unknown_pools in ROUTER_CHECKS  # the helper's checks still hold not_a_server_error
    report = fuzz_openapi(
        router_url, document, auth_headers=AUTH, max_examples=MAX_EXAMPLES_PER_OPERATION, checks=ROUTER_CHECKS
    )
    report.assert_clean()
    generate = "POST /generate"
    assert {200, 400, 503} <= report.statuses[generate]  # 503: a generated X-Miles-Pool the router does not know
    assert {"application/json", "text/event-stream"} <= report.media_types[generate]
    assert 404 in report.statuses["POST /v1/chat/completions"]  # miles-engine serves /generate only
    assert {200, 400, 401, 403, 422} <= report.statuses["POST /admin/v1/engines"]
    # The engine still serves through the router after the admin operations were fuzzed.
    answer = httpx.post(f"{router_url}/generate", json={"input_ids": [1, 2, 3]}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert engine_url in {e["url"] for e in httpx.get(f"{router_url}/admin/v1/engines", headers=AUTH).json()["engines"]}
