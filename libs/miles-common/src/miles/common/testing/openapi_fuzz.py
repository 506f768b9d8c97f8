"""A bounded schemathesis run over a live HTTP service: does the service answer what its OpenAPI says?

`fuzz_openapi` sends every documented operation a bounded number of generated requests (schemathesis, positive
and negative generation, plus the document's own examples) and checks every answer:

- `not_a_server_error`: no 5xx,
- `status_code_conformance`: the status is documented for the operation,
- `content_type_conformance`: the media type is documented for that status,
- `response_schema_conformance`: the body validates against the documented schema,
- `response_headers_conformance`: documented response headers are present and valid,
- `ndjson_conformance` (here: schemathesis does not read NDJSON): every line of an `application/x-ndjson` answer
  is JSON valid against the media type's schema (the schema of one line, as OpenAPI 3.1 reads event streams),
- and no request outlives `timeout_s` (a hang is a failure, not a wait).

Requests carry the caller's token most of the time and, now and then, no token or a wrong one, so that the
handlers run for real and the 401/403 answers are checked as well. Path parameters named in `live_path_values`
are sometimes replaced by ids of resources that exist (a session, a sandbox, a job), so that operations on a
resource are reached past their 404 (operations that DELETE run last, so that the live resources serve the
others first). Runs are derandomized (hypothesis's fixed seed; schemathesis may still order some choices by string
hash, so PYTHONHASHSEED can vary a run a little: test runs fix it, see pytest_plugin) and not shrunk: a failure is
reported with the request that found it, and every operation is run even when an earlier one fails. They do not
depend on the tests that ran before in the same process (pytest-xdist hands each worker other ones): hypothesis
also draws literals of the "local" modules loaded so far, and a run takes them from every module of the installed
`miles` packages instead (`repository_constants`), or from none (`seed_only_generation`).

Limits: requests are independent (no stateful sequences beyond the live ids the caller provides), so state
that only a sequence of calls reaches is not explored; the bound (`max_examples`) trades depth for CI time.
Imported by tests only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import requests
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants, constants_from_module
from schemathesis import GenerationMode
from schemathesis.checks import CheckContext, CheckFunction, not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.core.result import Err
from schemathesis.core.transport import Response
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import miles
from miles.common.serve import serve_async
from miles.common.testing.ports import free_port

CHECKS: tuple[CheckFunction, ...] = (
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
)
WRONG_TOKEN = "not-a-token-of-this-service-0123456789"
NDJSON = "application/x-ndjson"
MAX_FAILURE_CHARS = 3000


@dataclass
class FuzzReport:
    """What a run saw: the statuses each operation answered and its distinct failures."""

    statuses: dict[str, set[int]] = field(default_factory=dict)
    """"METHOD /path/template" -> every status it answered."""
    media_types: dict[str, set[str]] = field(default_factory=dict)
    """"METHOD /path/template" -> every media type it answered with (parameters dropped)."""
    failures: dict[str, dict[str, str]] = field(default_factory=dict)
    """"METHOD /path/template" -> failure title (a check's, or a hang) -> the first request that found it."""

    def add_failure(self, label: str, title: str, text: str) -> None:
        self.failures.setdefault(label, {}).setdefault(title, text[:MAX_FAILURE_CHARS])

    def assert_clean(self) -> None:
        """Fail the test naming every failing operation (with its request) when any check failed."""
        if self.failures:
            text = "\n\n".join(
                f"== {label}: {title}\n{failure}"
                for label, by_title in sorted(self.failures.items())
                for title, failure in by_title.items()
            )
            raise AssertionError(f"{len(self.failures)} operation(s) do not answer as documented:\n\n{text}")


def fuzz_openapi(
    base_url: str,
    document: dict[str, Any],
    *,
    auth_headers: Mapping[str, str] | None = None,
    live_path_values: Mapping[str, Sequence[str]] | None = None,
    max_examples: int = 25,
    max_examples_by_operation: Mapping[str, int] | None = None,
    timeout_s: float = 10.0,
    checks: Sequence[CheckFunction] = CHECKS,
) -> FuzzReport:
    """Run every operation of `document` against the service at `base_url` (see the module docstring).

    `auth_headers`: the headers of a valid caller (empty: the service is open). `max_examples_by_operation`
    ("POST /v1/x/{id}/exec": 5) bounds slow operations below `max_examples`.
    """
    schema = schemathesis.openapi.from_dict(document)
    checks = [*checks, ndjson_conformance(document)]
    report = FuzzReport()
    live = {name: list(values) for name, values in (live_path_values or {}).items() if values}
    operations = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()  # the document itself is broken: nothing to run
        operations.append(result.ok())
    # Deletes last: the live resources serve every other operation first.
    for operation in sorted(operations, key=lambda operation: operation.method.upper() == "DELETE"):
        label = f"{operation.method.upper()} {operation.path}"
        limit = (max_examples_by_operation or {}).get(label, max_examples)
        strategies = [operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
        strategies += operation.get_strategies_from_examples()
        send = _sender(base_url, dict(auth_headers or {}), live, list(checks), timeout_s, report, label)
        run = given(case=st.one_of(strategies), data=st.data())(send)
        run = settings(
            max_examples=limit,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(run)
        try:
            with repository_constants():
                run()
        except Exception as exc:  # e.g. the server went away: recorded, and the next operation still runs
            report.add_failure(label, type(exc).__name__, f"{type(exc).__name__}: {exc}")
    return report


_HYPOTHESIS_LOCAL_CONSTANTS = providers._get_local_constants


@contextlib.contextmanager
def _local_constants(constants: Callable[[], Constants]) -> Iterator[None]:
    """Hypothesis's pool of "local constants" replaced by `constants()` (reaches into hypothesis internals, whose
    version requirements/constraints.txt pins). Nothing changes when a caller replaced it already."""
    if providers._get_local_constants is not _HYPOTHESIS_LOCAL_CONSTANTS:
        yield
        return
    providers.CONSTANTS_CACHE.cache.clear()
    providers._get_local_constants = constants
    try:
        yield
    finally:
        providers._get_local_constants = _HYPOTHESIS_LOCAL_CONSTANTS
        providers.CONSTANTS_CACHE.cache.clear()


@functools.cache
def _repository_constants() -> Constants:
    pool = Constants()
    for directory in sorted(miles.__path__):
        for path in sorted(Path(directory).rglob("*.py")):
            module = types.ModuleType(path.stem)
            module.__file__ = str(path)
            pool |= constants_from_module(module)  # cached by hypothesis under .hypothesis/constants
    return pool


def repository_constants() -> contextlib.AbstractContextManager[None]:
    """The default of `fuzz_openapi`: hypothesis draws the literals of every module of the installed `miles`
    packages (libs, services, cli; what a process that imported all of them would see), instead of those of the
    modules this process happens to have loaded, which depend on the tests that ran before in it (in a parallel
    run, on how pytest-xdist spread them). Some runs reach answers only through such literals."""
    return _local_constants(_repository_constants)


def seed_only_generation() -> contextlib.AbstractContextManager[None]:
    """Opt-in: generated requests that depend on the seed only (no local constants at all). Applies to every
    `fuzz_openapi` run inside it."""
    return _local_constants(Constants)


def ndjson_conformance(document: dict[str, Any]) -> CheckFunction:
    """A check: each line of an `application/x-ndjson` answer is JSON valid against the schema the document gives
    that media type for that status (`$ref`s into the document's components resolve)."""
    components = document.get("components", {})

    def ndjson_conformance(ctx: CheckContext, response: Response, case: schemathesis.Case[Any]) -> bool | None:
        content_type = (response.headers.get("content-type") or [""])[0].split(";")[0].strip()
        if content_type != NDJSON:
            return None
        responses = document["paths"][case.path][case.method.lower()]["responses"]
        media_type = responses.get(str(response.status_code), {}).get("content", {}).get(NDJSON, {})
        if "schema" not in media_type:
            return None  # an undocumented media type is content_type_conformance's failure
        validator = jsonschema_rs.validator_for({**media_type["schema"], "components": components})
        for number, line in enumerate(response.content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise AssertionError(f"NDJSON line {number} is not JSON ({exc}): {line[:200]!r}") from None
            problems = [error.message for error in validator.iter_errors(item)]
            if problems:
                raise AssertionError(f"NDJSON line {number} breaks its schema: {problems[:3]}: {line[:200]!r}")
        return None

    return ndjson_conformance


def _sender(
    base_url: str,
    auth_headers: dict[str, str],
    live: dict[str, list[str]],
    checks: list[CheckFunction],
    timeout_s: float,
    report: FuzzReport,
    label: str,
) -> Callable[[schemathesis.Case[Any], st.DataObject], None]:
    def send(case: schemathesis.Case[Any], data: st.DataObject) -> None:
        for name, values in live.items():
            if case.path_parameters and name in case.path_parameters and data.draw(st.booleans(), label="live"):
                case.path_parameters[name] = data.draw(st.sampled_from(values), label=name)
        headers = dict(auth_headers)
        if auth_headers:
            # Mostly the valid token (the handlers run); sometimes none or a wrong one (the 401/403 answers).
            variant = data.draw(st.integers(0, 7), label="auth")
            if variant < 2:
                names = {name.lower() for name in auth_headers}
                headers = {} if variant == 0 else {name: f"Bearer {WRONG_TOKEN}" for name in auth_headers}
                for name in [name for name in (case.headers or {}) if name.lower() in names]:
                    del case.headers[name]  # type: ignore[union-attr]
        # Failures are recorded, not raised: generation goes on and finds the operation's other distinct failures.
        try:
            response = case.call_and_validate(base_url=base_url, headers=headers, checks=checks, timeout=timeout_s)
        except requests.Timeout:
            report.add_failure(label, "hang", f"no answer within {timeout_s} s\n{case.as_curl_command()}")
            return
        except (Failure, FailureGroup) as exc:
            for failure in exc.exceptions if isinstance(exc, FailureGroup) else [exc]:
                first_line = (failure.message or "").strip().split("\n", 1)[0]
                report.add_failure(label, f"{failure.title}: {first_line}"[:200], str(exc))
            return
        report.statuses.setdefault(label, set()).add(response.status_code)
        content_type = response.headers.get("content-type")
        if content_type:
            report.media_types.setdefault(label, set()).add(content_type[0].split(";")[0].strip())

    return send


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, *, ready_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve `app` (its lifespan included) with uvicorn on a free loopback port from a daemon thread; yields the
    base URL once /healthz answers and stops the server on exit."""
    port = free_port()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def serve() -> None:
        loop.run_until_complete(serve_async(http_app=app, http_port=port, stop_event=stop, handle_signals=False))

    thread = threading.Thread(target=serve, name="openapi-fuzz-server", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline_s = time.monotonic() + ready_timeout_s
    while True:
        try:
            if httpx.get(f"{base_url}/healthz", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline_s or not thread.is_alive():
            raise RuntimeError(f"the app did not answer /healthz on {base_url} within {ready_timeout_s} s")
        time.sleep(0.02)
    try:
        yield base_url
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        loop.close()
