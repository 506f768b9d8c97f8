"""configure_logging: no per-request INFO lines from the HTTP client (a proxied turn would log one each), which
are still there at DEBUG."""

from __future__ import annotations

import logging

import httpx
import pytest

from miles.common.logs import configure_logging


@pytest.mark.parametrize(("level", "logged"), [("INFO", False), ("DEBUG", True)])
def test_http_client_requests_are_logged_only_at_debug(
    level: str, logged: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("test", level, json_lines=False)
        transport = httpx.MockTransport(lambda request: httpx.Response(204))
        with httpx.Client(transport=transport) as client:
            client.get("http://engine.test/health")
        logging.getLogger("miles.test").info("service line")
        err = capsys.readouterr().err
        assert "service line" in err
        assert ("HTTP Request: GET http://engine.test/health" in err) is logged, err
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.NOTSET)
