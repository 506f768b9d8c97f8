"""The gateway's HTTP facade answers what its published OpenAPI says: a bounded schemathesis run over every
operation, against a real gateway process with the local (bubblewrap) backend and an operator token.

Every operation gets generated requests, positive and negative, mostly with the operator token; every answer
must be a documented status with a documented media type (the exec route's NDJSON lines checked one by one) and a
body and headers as documented, never a 5xx, never a hang (miles.common.testing.openapi_fuzz). A live sandbox
stands behind some of the generated ids. Execs are bounded by the gateway (max_timeout_s), so none outlives the
per-request timeout; exec is the slow operation (each runs processes) and gets fewer examples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import pytest

from miles.common.testing.openapi_fuzz import fuzz_openapi

if TYPE_CHECKING:
    from conftest import Gateway

pytestmark = pytest.mark.integration

OPERATOR = "operator-token-for-openapi-tests-0123456789"
MAX_EXAMPLES_PER_OPERATION = 30
EXEC = "POST /v1/sandboxes/{sandbox_id}/exec"


def test_every_answer_is_documented(start_gateway_process: Callable[..., Gateway]) -> None:
    gateway = start_gateway_process(
        OPERATOR_TOKEN=OPERATOR,
        WARM_POOL_SIZE="0",
        MAX_TIMEOUT_S="3",
        DEFAULT_TIMEOUT_S="2",
        MAX_TTL_S="120",
        DEFAULT_TTL_S="60",
    )
    auth = {"authorization": f"Bearer {OPERATOR}"}
    document = httpx.get(f"{gateway.http_base}/openapi.json").json()
    schemas = document["components"]["schemas"]  # the settings' bounds are stated
    assert schemas["CreateBody"]["properties"]["ttl_s"]["maximum"] == 120.0
    assert schemas["ExecBody"]["properties"]["timeout_s"]["maximum"] == 3.0
    created = httpx.post(f"{gateway.http_base}/v1/sandboxes", json={"job_id": "openapi"}, headers=auth, timeout=60)
    assert created.status_code == 201, created.text
    report = fuzz_openapi(
        gateway.http_base,
        document,
        auth_headers=auth,
        live_path_values={"sandbox_id": [created.json()["sandbox_id"]]},
        max_examples=MAX_EXAMPLES_PER_OPERATION,
        max_examples_by_operation={EXEC: 20},
        timeout_s=20.0,
    )
    report.assert_clean()
    assert {200, 401, 404} <= report.statuses[EXEC]  # the live sandbox, no token, an unknown id
    assert {"application/json", "application/x-ndjson"} <= report.media_types[EXEC]  # stream: false and true
    assert 201 in report.statuses["POST /v1/sandboxes"]
