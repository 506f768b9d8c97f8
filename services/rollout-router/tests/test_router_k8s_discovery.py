"""Kubernetes discovery with the official client against a small fake Kubernetes API (list + watch)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from miles.router.k8s_discovery import desired_engines

pytestmark = pytest.mark.integration

LABELS = {"app.kubernetes.io/component": "engine"}


def endpoint_slice(name: str, pool: str | None, port: int, addresses: list[str], **conditions: Any) -> dict[str, Any]:
    labels = {**LABELS, "kubernetes.io/service-name": f"svc-{name}"}
    if pool is not None:
        labels["miles.dev/pool"] = pool
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "miles", "labels": labels},
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": 9999}, {"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": addresses, "conditions": {"ready": True, **conditions}}],
    }


class FakeKubeApi:
    """The two EndpointSlice calls the client makes: list (JSON) and watch (chunked JSON lines), with 410 expiry."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.resource_version = 100
        self.expire_next_watch = False
        self.silent = False
        self.num_lists = 0
        self.cond = threading.Condition()
        self.stopping = False
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                api.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def put(self, obj: dict[str, Any]) -> None:
        with self.cond:
            kind = "MODIFIED" if obj["metadata"]["name"] in self.slices else "ADDED"
            self._record(kind, obj)
            self.slices[obj["metadata"]["name"]] = obj

    def delete(self, name: str) -> None:
        with self.cond:
            self._record("DELETED", self.slices.pop(name))

    def _record(self, kind: str, obj: dict[str, Any]) -> None:
        self.resource_version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.resource_version)
        self.events.append((self.resource_version, kind, obj))
        self.cond.notify_all()

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(request.path)
        query = {key: values[0] for key, values in parse_qs(parts.query).items()}
        if parts.path != "/apis/discovery.k8s.io/v1/namespaces/miles/endpointslices":
            body = b'{"kind": "Status", "code": 404}'
            request.send_response(404)
            request.send_header("content-length", str(len(body)))
            request.end_headers()
            request.wfile.write(body)
            return
        selector = dict(item.split("=", 1) for item in query.get("labelSelector", "").split(",") if item)
        if query.get("watch") == "true":
            self._watch(request, int(query.get("resourceVersion") or 0), float(query["timeoutSeconds"]), selector)
            return
        with self.cond:
            self.num_lists += 1
            items = [obj for obj in self.slices.values() if _matches(obj, selector)]
            listing = {
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.resource_version)},
                "items": items,
            }
            body = json.dumps(listing).encode()
        request.send_response(200)
        request.send_header("content-type", "application/json")
        request.send_header("content-length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    def _watch(self, request: BaseHTTPRequestHandler, since: int, timeout_s: float, selector: dict[str, str]) -> None:
        request.send_response(200)
        request.send_header("content-type", "application/json")
        request.send_header("transfer-encoding", "chunked")
        request.end_headers()

        def send(event: dict[str, Any]) -> None:
            line = json.dumps(event).encode() + b"\n"
            request.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            request.wfile.flush()

        try:
            with self.cond:
                expire, self.expire_next_watch = self.expire_next_watch, False
            if expire:
                gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"}
                send({"type": "ERROR", "object": gone})
            else:
                self._stream_events(send, since, timeout_s, selector)
            request.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            return

    def _stream_events(self, send: Any, since: int, timeout_s: float, selector: dict[str, str]) -> None:
        sent = since
        with self.cond:
            remaining = timeout_s
            while not self.stopping and remaining > 0:
                for version, kind, obj in self.events:
                    if version > sent and _matches(obj, selector) and not self.silent:
                        send({"type": kind, "object": obj})
                    sent = max(sent, version)
                if self.cond.wait(timeout=min(remaining, 0.5)):
                    continue
                remaining -= 0.5

    def __enter__(self) -> FakeKubeApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


@pytest.fixture
def kube_api() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as api:
        yield api


def discovery_settings(kube_api: FakeKubeApi) -> dict[str, Any]:
    return {"k8s_discovery": True, "k8s_api_url": kube_api.url, "k8s_namespace": "miles", "k8s_watch_timeout_s": 2}


def engine_urls(router: Any, pool: str) -> set[str]:
    """Engines registered in a pool and probed healthy (registration probes before an engine takes requests)."""
    registered = router.service.registry.pools.get(pool)
    if registered is None:
        return set()
    return {url for url, engine in registered.engines.items() if engine.health.healthy}


async def test_discovery_follows_endpoint_slices(
    engines: Any, start_router: Any, kube_api: FakeKubeApi, until: Any
) -> None:
    engine_a1, engine_a2, engine_b = await engines(3)
    kube_api.put(endpoint_slice("a1", "job-a", engine_a1.port, ["127.0.0.1"]))
    kube_api.put({**endpoint_slice("other", "job-a", 1, ["127.0.0.1"]), "metadata": {"name": "other", "labels": {}}})
    async with start_router(**discovery_settings(kube_api)) as router:
        await until(lambda: router.service.discovery.synced.is_set())
        assert (await router.client.get("/readyz")).status_code == 200
        assert engine_urls(router, "job-a") == {engine_a1.url}  # the unlabelled slice is not ours
        response = await router.client.post("/generate", json={"input_ids": [1]}, headers={"X-Miles-Pool": "job-a"})
        assert response.status_code == 200 and response.json()["engine"] == engine_a1.url

        kube_api.put(endpoint_slice("a2", "job-a", engine_a2.port, ["127.0.0.1"]))
        kube_api.put(endpoint_slice("b", None, engine_b.port, ["127.0.0.1"]))  # no pool label: the Service name
        await until(lambda: engine_urls(router, "job-a") == {engine_a1.url, engine_a2.url})
        await until(lambda: engine_urls(router, "svc-b") == {engine_b.url})
        listed = (await router.client.get("/admin/v1/engines", params={"pool": "svc-b"})).json()["engines"]
        assert listed[0]["source"] == "kubernetes" and listed[0]["state"] == "healthy"

        kube_api.put(endpoint_slice("a2", "job-a", engine_a2.port, ["127.0.0.1"], ready=False))
        await until(lambda: engine_urls(router, "job-a") == {engine_a1.url})
        kube_api.delete("b")
        await until(lambda: engine_urls(router, "svc-b") == set())


async def test_discovery_relists_after_410_and_keeps_admin_engines(
    engines: Any, start_router: Any, kube_api: FakeKubeApi, until: Any
) -> None:
    discovered, manual, later = await engines(3)
    kube_api.put(endpoint_slice("d", "job", discovered.port, ["127.0.0.1"]))
    async with start_router(**discovery_settings(kube_api)) as router:
        await until(lambda: engine_urls(router, "job") == {discovered.url})
        await router.service.admin.register_engine("job", manual.url)
        # Changes the running watch never delivers, then 410 Gone on renewal: only a fresh list can see them.
        kube_api.silent = True
        kube_api.delete("d")
        kube_api.put(endpoint_slice("l", "job", later.port, ["127.0.0.1"]))
        kube_api.expire_next_watch = True
        await until(lambda: engine_urls(router, "job") == {manual.url, later.url})
        assert kube_api.num_lists == 2


def test_desired_engines_reads_ports_conditions_and_pools() -> None:
    from miles.router.settings import RouterSettings

    settings = RouterSettings(k8s_port_name="http")
    slices = {
        "1": endpoint_slice("x", "p", 30000, ["10.0.0.1", "10.0.0.2"]),
        "2": endpoint_slice("y", "p", 30001, ["fd00::1"]),
        "3": endpoint_slice("z", "p", 30002, ["10.0.0.3"], terminating=True),
        "4": {**endpoint_slice("w", "q", 1, ["10.0.0.4"]), "endpoints": [{"addresses": ["10.0.0.4"]}]},
    }
    assert desired_engines(slices, settings) == {
        "p": {"http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://[fd00::1]:30001"},
        "q": {"http://10.0.0.4:1"},  # no conditions: ready (unknown counts as ready)
    }
