"""SGLang's --api-key / --admin-api-key semantics on every engine route, against real miles-engine processes (fake
model) over HTTP: control routes need the admin key (else the api key, else nothing), the other routes the api key
when one is set, probes never a key; keys come from flags or from MILES_ENGINE_* variables, and an engine on a
network interface without a key refuses to start."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from miles.common.auth import MIN_TOKEN_CHARS
from miles.common.testing import free_port
from miles.common.testing.smoke import console_script
from miles.engine.auth import CONTROL_PATHS
from miles.engine.main import parse_flags
from miles.engine.settings import EngineSettings

API_KEY = "a" * MIN_TOKEN_CHARS
ADMIN_KEY = "d" * MIN_TOKEN_CHARS
WRONG_KEY = "w" * MIN_TOKEN_CHARS
OPEN_PATHS = ("/health", "/health_generate", "/healthz", "/readyz", "/metrics")
REFUSED = (401, 403)


@pytest.fixture(scope="module")
def both_keys_engine(tiny_model_dir: Path, engine_factory: Any) -> Iterator[httpx.Client]:
    """A miles-engine given both keys as SGLang flags; yields an HTTP client to it (no key of its own)."""
    flags = ("--fake-model", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)
    with engine_factory(tiny_model_dir, *flags) as engine:
        yield engine.client


@contextlib.contextmanager
def engine_from_env(
    tiny_model_dir: Path, engine_factory: Any, monkeypatch: pytest.MonkeyPatch, **env: str
) -> Iterator[httpx.Client]:
    """A miles-engine whose keys come from the environment, as the controller sets them (MILES_ENGINE_API_KEY,
    MILES_ENGINE_ADMIN_API_KEY)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with engine_factory(tiny_model_dir, "--fake-model") as engine:
        yield engine.client


def guarded_operations(client: httpx.Client) -> list[tuple[str, str]]:
    """(method, path) of every documented route except the open probes: a route added later is checked too."""
    paths = client.get("/openapi.json").json()["paths"]
    return sorted(
        (method.upper(), path) for path, operations in paths.items() if path not in OPEN_PATHS for method in operations
    )


def status(client: httpx.Client, method: str, path: str, key: str | None) -> int:
    """The status of one call. A JSON list as body fails every body schema, so a call that gets past the key
    check changes nothing (routes without a body only flush an idle cache or read)."""
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    content = b"[]" if method != "GET" else None
    return client.request(method, path, headers=headers, content=content).status_code


def check_route(client: httpx.Client, method: str, path: str, accepted: set[str | None], refused: set[str]) -> None:
    where = f"{method} {path}"
    for key in accepted:
        assert status(client, method, path, key) not in REFUSED, f"{where} refused {key!r}"
    for key in refused:
        assert status(client, method, path, key) == 403, f"{where} accepted {key!r}"
    if None not in accepted:
        assert status(client, method, path, None) == 401, f"{where} without a key"


@pytest.mark.integration
def test_control_routes_are_exactly_the_routes_that_change_state(both_keys_engine: httpx.Client) -> None:
    """Every route that takes a POST but /generate changes the engine's state; each must be a control route, and
    the OpenAPI document says that every guarded route may answer 401 and 403."""
    paths = both_keys_engine.get("/openapi.json").json()["paths"]
    changing = {path for path, operations in paths.items() if "post" in operations and path != "/generate"}
    assert changing == CONTROL_PATHS
    for path, operations in paths.items():
        for method, operation in operations.items():
            documented = {"401", "403"} <= set(operation["responses"])
            assert documented == (path not in OPEN_PATHS), f"{method} {path}"


@pytest.mark.integration
def test_with_both_keys_control_routes_take_only_the_admin_key(both_keys_engine: httpx.Client) -> None:
    operations = guarded_operations(both_keys_engine)
    assert len(operations) >= 25
    for method, path in operations:
        if path in CONTROL_PATHS:
            check_route(both_keys_engine, method, path, accepted={ADMIN_KEY}, refused={API_KEY, WRONG_KEY})
        else:
            check_route(both_keys_engine, method, path, accepted={API_KEY}, refused={ADMIN_KEY, WRONG_KEY})
    answer = both_keys_engine.post(
        "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
        headers={"authorization": f"Bearer {API_KEY}"},
    )
    assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2


@pytest.mark.integration
def test_probes_and_metrics_never_need_a_key(both_keys_engine: httpx.Client) -> None:
    for path in OPEN_PATHS:
        assert both_keys_engine.get(path).status_code == 200, path


@pytest.mark.integration
def test_refusals_use_the_common_error_body(both_keys_engine: httpx.Client) -> None:
    missing = both_keys_engine.post("/pause_generation", json={})
    wrong = both_keys_engine.post("/pause_generation", json={}, headers={"authorization": f"Bearer {API_KEY}"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "unauthenticated")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (403, "permission_denied")


@pytest.mark.integration
def test_with_only_an_api_key_control_routes_take_the_api_key(
    tiny_model_dir: Path, engine_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with engine_from_env(tiny_model_dir, engine_factory, monkeypatch, MILES_ENGINE_API_KEY=API_KEY) as client:
        for method, path in guarded_operations(client):
            check_route(client, method, path, accepted={API_KEY}, refused={WRONG_KEY})


@pytest.mark.integration
def test_with_only_an_admin_key_generation_routes_stay_open(
    tiny_model_dir: Path, engine_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with engine_from_env(tiny_model_dir, engine_factory, monkeypatch, MILES_ENGINE_ADMIN_API_KEY=ADMIN_KEY) as client:
        for method, path in guarded_operations(client):
            if path in CONTROL_PATHS:
                check_route(client, method, path, accepted={ADMIN_KEY}, refused={WRONG_KEY})
            else:
                check_route(client, method, path, accepted={None, WRONG_KEY, ADMIN_KEY}, refused=set())
        answer = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2


@pytest.mark.integration
def test_without_keys_every_route_is_open(tiny_model_dir: Path, engine_factory: Any) -> None:
    with engine_factory(tiny_model_dir, "--fake-model") as engine:
        for method, path in guarded_operations(engine.client):
            check_route(engine.client, method, path, accepted={None, WRONG_KEY}, refused=set())


@pytest.mark.integration
def test_an_engine_on_a_network_interface_without_a_key_refuses_to_start(tiny_model_dir: Path) -> None:
    argv = [console_script("miles-engine"), "--model-path", str(tiny_model_dir), "--fake-model"]
    argv += ["--host", "0.0.0.0", "--port", str(free_port())]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert "admin_api_key (or api_key) is required when host is '0.0.0.0'" in result.stderr


@pytest.mark.parametrize("keys", [{"api_key": API_KEY}, {"admin_api_key": ADMIN_KEY}])
def test_a_network_engine_starts_with_either_key(keys: dict[str, str]) -> None:
    EngineSettings(model_path=Path("/models/x"), host="0.0.0.0", **keys)


def test_a_network_engine_without_keys_is_refused() -> None:
    required = r"admin_api_key \(or api_key\) is required when host is '0\.0\.0\.0'"
    with pytest.raises(ValidationError, match=required):
        EngineSettings(model_path=Path("/models/x"), host="0.0.0.0")


@pytest.mark.parametrize("field", ["api_key", "admin_api_key"])
def test_short_keys_are_refused(field: str) -> None:
    with pytest.raises(ValidationError, match=f"at least {MIN_TOKEN_CHARS} characters"):
        EngineSettings(model_path=Path("/models/x"), **{field: "short"})


def test_keys_are_sglang_flags() -> None:
    flags: dict[str, Any] = parse_flags(["--model-path", "/m", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY])
    settings = EngineSettings(**flags)
    assert (settings.api_key.get_secret_value(), settings.admin_api_key.get_secret_value()) == (API_KEY, ADMIN_KEY)
    assert API_KEY not in repr(settings)
