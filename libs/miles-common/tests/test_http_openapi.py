"""The OpenAPI document the common app factory publishes says what every app answers: the probes with their media
types, the `Error` body of every error answer, the router's own 404/405, an undecodable body and an encoded `/` in
a path in that shape; and the schemathesis helper (miles.common.testing.openapi_fuzz) finds an answer the
document does not state."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Header, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from miles.common.errors import MilesError, NotFoundError
from miles.common.http import create_http_app, error_response
from miles.common.telemetry import Metrics
from miles.common.testing.openapi_fuzz import fuzz_openapi, serve_in_thread

ERROR_REF = {"$ref": "#/components/schemas/Error"}


class TeapotError(MilesError):
    http_status = 418
    code = "teapot"


class Item(BaseModel):
    name: str = Field(min_length=1)
    count: int = Field(ge=0)


def make_app(*, document_the_teapot: bool) -> FastAPI:
    def describe_the_count(document: dict[str, Any]) -> None:
        document["components"]["schemas"]["Item"]["properties"]["count"]["description"] = "How many, >= 0"

    app = create_http_app(service="demo", metrics=Metrics("demo"), openapi_hooks=[describe_the_count])

    @app.post("/v1/items", status_code=201)
    async def create_item(item: Item) -> Item:
        return item

    teapot: dict[int | str, dict[str, Any]] = {418: {"description": "Short and stout"}}

    @app.get("/v1/items/{item_id}", responses={404: {"description": "No such item"}})
    async def get_item(
        item_id: str,
        x_trace: str | None = Header(default=None),
        verbose: bool | None = Query(default=None),
    ) -> Item:
        raise NotFoundError(f"no item {item_id!r}", field="item_id")

    @app.get("/v1/teapot", responses=teapot if document_the_teapot else {})
    async def teapot_route() -> JSONResponse:
        return error_response(TeapotError("short and stout"))

    return app


@pytest.fixture
def document() -> dict[str, Any]:
    return make_app(document_the_teapot=True).openapi()


def test_probes_are_documented_with_their_media_types(document: dict[str, Any]) -> None:
    paths = document["paths"]
    assert set(paths["/healthz"]["get"]["responses"]["200"]["content"]) == {"application/json"}
    assert set(paths["/readyz"]["get"]["responses"]) >= {"200", "503"}
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_every_error_answer_has_the_error_body_and_every_answer_a_request_id(document: dict[str, Any]) -> None:
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            for status, response in operation["responses"].items():
                assert "X-Request-ID" in response["headers"], (method, path, status)
                if status[0] in "45" and path != "/readyz":  # /readyz's 503 is its report, named `Readiness`
                    assert response["content"] == {"application/json": {"schema": ERROR_REF}}, (method, path, status)
    assert "HTTPValidationError" not in document["components"]["schemas"]
    assert "Retry-After" in document["paths"]["/readyz"]["get"]["responses"]["503"]["headers"]


def test_parameters_have_no_json_null_and_hooks_complete_the_document(document: dict[str, Any]) -> None:
    parameters = {p["name"]: p["schema"] for p in document["paths"]["/v1/items/{item_id}"]["get"]["parameters"]}
    assert parameters["x-trace"]["type"] == "string" and "anyOf" not in parameters["x-trace"]
    assert parameters["verbose"]["type"] == "boolean"
    assert document["components"]["schemas"]["Item"]["properties"]["count"]["description"] == "How many, >= 0"


async def test_router_answers_and_undecodable_bodies_use_the_error_body() -> None:
    transport = httpx.ASGITransport(app=make_app(document_the_teapot=True))
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as http:
        missing = await http.get("/v1/nothing-here")
        wrong_method = await http.delete("/v1/items")
        not_text = await http.post(
            "/v1/items", content=b'{"name": "\xff"}', headers={"content-type": "application/json"}
        )
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    assert (wrong_method.status_code, wrong_method.json()["error"]["code"]) == (405, "method_not_allowed")
    assert "allow" in wrong_method.headers
    assert (not_text.status_code, not_text.json()["error"]["field"]) == (422, "body")


async def test_an_encoded_slash_in_a_path_is_refused_not_routed_elsewhere(document: dict[str, Any]) -> None:
    transport = httpx.ASGITransport(app=make_app(document_the_teapot=True))
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as http:
        slashed = await http.get("/v1/items/a%2Fb")
        plain = await http.get("/v1/items/a%20b")
    assert (slashed.status_code, slashed.json()["error"]["field"]) == (422, "path")
    assert plain.status_code == 404 and plain.json()["error"]["field"] == "item_id"  # other escapes are ids
    (item_id,) = [p for p in document["paths"]["/v1/items/{item_id}"]["get"]["parameters"] if p["in"] == "path"]
    assert item_id["schema"]["pattern"] == "^[^/]+$"


@pytest.mark.integration
def test_the_fuzz_run_is_clean_for_a_documented_app_and_names_an_undocumented_status() -> None:
    for documented in (True, False):
        app = make_app(document_the_teapot=documented)
        with serve_in_thread(app) as base_url:
            report = fuzz_openapi(base_url, httpx.get(f"{base_url}/openapi.json").json(), max_examples=10)
        if documented:
            report.assert_clean()
            assert {201, 422} <= report.statuses["POST /v1/items"]
        else:
            assert list(report.failures) == ["GET /v1/teapot"]
            assert "418" in next(iter(report.failures["GET /v1/teapot"]))
