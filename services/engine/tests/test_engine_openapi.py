"""The engine's published OpenAPI matches what it answers: a bounded schemathesis run over every operation.

A real `miles-engine --fake-model` process (the real protocol, scheduler and radix cache, a cheap sampler) with an
api_key, so that the generation and the control routes both check a token. Every operation gets generated
requests, positive and negative, mostly with the key; every answer must be a documented status with a documented
media type and a body as documented, never a 5xx, never a hang (miles.common.testing.openapi_fuzz).

State: a paused engine holds every later /generate until /continue_generation, so /pause_generation is fuzzed
last, on its own, and the engine is resumed afterwards. Every other control route leaves the engine usable
(flushes, aborts, version changes, refused weight updates), which the test checks at the end.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.auth import MIN_TOKEN_CHARS
from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.openapi_fuzz import fuzz_openapi
from miles.common.testing.openapi_fuzz import seed_only_generation as fuzz_seed_only
from miles.common.testing.smoke import console_script

pytestmark = pytest.mark.integration

API_KEY = "k" * MIN_TOKEN_CHARS
AUTH = {"authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES_PER_OPERATION = 30
PAUSE = "POST /pause_generation"
ENGINE_FLAGS = (
    "--fake-model",
    *("--api-key", API_KEY),
    # Bounded work and waits (the document states the first two), so that every fuzzed request answers well
    # within the fuzzer's timeout: at most 8 sequences of at most 512 tokens per request.
    *("--context-length", "512"),
    *("--max-running-requests", "8"),
    *("--health-generate-timeout-s", "2"),
    *("--weight-update-group-timeout-s", "1"),
)


def write_fake_model_dir(out: Path) -> Path:
    """The tiny Qwen3 config and the real Qwen3 tokenizer: all that `--fake-model` reads (no weights, no torch)."""
    from miles.engine.tiny_model import TINY_QWEN3_CONFIG, TOKENIZER_FILES, qwen3_tokenizer_dir

    (out / "config.json").write_text(json.dumps(TINY_QWEN3_CONFIG))
    for name in TOKENIZER_FILES:
        shutil.copyfile(qwen3_tokenizer_dir() / name, out / name)
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    """(base URL, OpenAPI document) of a miles-engine --fake-model process."""
    model_dir = write_fake_model_dir(tmp_path_factory.mktemp("fake-model"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [console_script("miles-engine"), "--model-path", str(model_dir), "--port", str(port), *ENGINE_FLAGS]
    log_path = tmp_path_factory.mktemp("engine-logs") / "engine.log"
    with ServiceProcess(argv, ready_url=f"{url}/readyz", log_path=log_path):
        # The first group creation imports torch (seconds; more on a busy machine): once here, so that the fuzzer's
        # per-request timeout measures the route and not that import.
        group = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank_offset": 1}
        assert httpx.post(f"{url}/init_weights_update_group", json=group, headers=AUTH, timeout=120).status_code == 400
        yield url, httpx.get(f"{url}/openapi.json").json()


@pytest.fixture
def seed_only_generation() -> Iterator[None]:
    """Requests that depend on the seed only (see openapi_fuzz.seed_only_generation)."""
    with fuzz_seed_only():
        yield


def only(document: dict[str, Any], labels: set[str], *, keep: bool) -> dict[str, Any]:
    """A copy of `document` with only the operations ("POST /path") in `labels` (keep) or all but them."""
    paths: dict[str, Any] = {}
    for path, path_item in document["paths"].items():
        operations = {
            method: operation
            for method, operation in path_item.items()
            if (f"{method.upper()} {path}" in labels) == keep
        }
        if operations:
            paths[path] = operations
    return {**document, "paths": paths}


def test_openapi_states_sglang_answers(engine: tuple[str, dict[str, Any]]) -> None:
    _, document = engine
    paths = document["paths"]
    assert not [
        (method, path) for path, item in paths.items() for method, op in item.items() if "422" in op["responses"]
    ], "schema errors are SGLang's 400, never 422"
    assert set(paths["/flush_cache"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "content" not in paths["/health"]["get"]["responses"]["200"]  # an empty body: no media type
    assert "content" not in paths["/health_generate"]["get"]["responses"]["503"]
    generate = paths["/generate"]["post"]
    assert set(generate["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "401", "403", "409"} <= set(generate["responses"])
    assert paths["/abort_request"]["post"]["requestBody"]["required"] is True
    timeout = paths["/flush_cache"]["post"]["parameters"][0]["schema"]
    assert timeout["minimum"] == 0
    body = generate["requestBody"]["content"]["application/json"]["schema"]["properties"]
    prompt = body["input_ids"]["anyOf"][0]
    assert prompt["items"] == {"type": "integer", "minimum": 0, "maximum": 151935}  # the model's vocabulary
    assert prompt["maxItems"] == 511  # --context-length 512
    assert body["sampling_params"]["anyOf"][0]["properties"]["n"]["maximum"] == 8  # --max-running-requests 8


def test_malformed_requests_get_sglang_400s(engine: tuple[str, dict[str, Any]]) -> None:
    url, _ = engine
    not_utf8 = httpx.post(
        f"{url}/abort_request", content=b'{"rid": "\xff"}', headers={**AUTH, "content-type": "application/json"}
    )
    assert (not_utf8.status_code, not_utf8.json()["object"]) == (400, "error")  # SGLang's body, not a 422
    for version in (b"--1", "\u00b2".encode("latin-1"), b"v3"):  # int() refuses them all
        headers = {**AUTH, "X-Miles-Min-Weight-Version": version}
        answer = httpx.post(f"{url}/generate", json={"input_ids": [1]}, headers=headers)
        assert (answer.status_code, answer.json()["error"]["code"]) == (400, "bad_request"), version
    for timeout in ("-1", "inf", "nan"):
        flush = httpx.post(f"{url}/flush_cache", params={"timeout": timeout}, headers=AUTH)
        assert (flush.status_code, flush.json()["object"]) == (400, "error"), timeout


def test_every_answer_is_documented(engine: tuple[str, dict[str, Any]], seed_only_generation: None) -> None:
    url, document = engine
    report = fuzz_openapi(
        url, only(document, {PAUSE}, keep=False), auth_headers=AUTH, max_examples=MAX_EXAMPLES_PER_OPERATION
    )
    paused = fuzz_openapi(url, only(document, {PAUSE}, keep=True), auth_headers=AUTH, max_examples=10)
    assert httpx.post(f"{url}/continue_generation", headers=AUTH).status_code == 200
    report.assert_clean()
    paused.assert_clean()
    generate = "POST /generate"
    assert {200, 400} <= report.statuses[generate]
    assert {"application/json", "text/event-stream"} <= report.media_types[generate]
    assert {401, 403} <= set().union(*report.statuses.values())  # valid handlers ran, and refused tokens too
    assert 200 in paused.statuses[PAUSE]
    assert 200 in report.statuses["POST /update_weights_from_tensor"]  # the document's example payload
    # The engine still serves after every control route was fuzzed.
    answer = httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3]}, headers=AUTH, timeout=30)
    assert answer.status_code == 200, answer.text
