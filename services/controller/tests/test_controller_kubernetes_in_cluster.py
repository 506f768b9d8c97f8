"""`KubernetesJobBackend.from_settings`, the way the controller builds its backend in a pod, against the fake API
(controller_kubernetes_testkit) served the way a cluster serves it: HTTPS with a certificate only the service
account's `ca.crt` vouches for, and a bearer token from the service account's `token` file.

In a pod the kubelet mounts the service account at /var/run/secrets/kubernetes.io/serviceaccount and sets
KUBERNETES_SERVICE_HOST/PORT; here the same files are written under tmp_path (the client's and the backend's
paths to them patched) and the variables point at the fake. A job started through that backend creates its
objects in the namespace the mounted `namespace` file names, with every request authenticated by the mounted
token over a verified TLS connection. The kubeconfig path is checked too (`kubernetes_config: kubeconfig`).
Needs the `openssl` command (Debian's openssl package) for the self-signed certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from controller_kubernetes_testkit import NAMESPACE, TEMPLATES, FakeKubernetesApi
from fastapi import Request, Response
from kubernetes import client as k8s
from kubernetes.config import incluster_config, kube_config
from kubernetes.config.config_exception import ConfigException

from miles.common.jobspec.job import JobSpec
from miles.common.testing.helm import render_chart
from miles.controller.backends import kubernetes as kubernetes_backend
from miles.controller.backends.kubernetes import KubernetesJobBackend

pytestmark = pytest.mark.integration
REDIS_URL = "redis://127.0.0.1:1/0"  # never connected to: the backend alone is built
SERVICE_ACCOUNT_TOKEN = "service-account-token-0123456789abcdef"


@pytest.fixture(scope="module")
def job_templates(request: pytest.FixtureRequest) -> dict[str, str]:
    objects = render_chart(Path(request.config.rootpath) / "helm" / "miles", namespace=NAMESPACE)
    (config_map,) = [obj for obj in objects if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == TEMPLATES]
    return dict(config_map["data"])


@pytest.fixture(autouse=True)
def _restore_client_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config loaders install a process-wide default Configuration: put the previous one back afterwards."""
    monkeypatch.setattr(k8s.Configuration, "_default", k8s.Configuration._default)


def _self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (it is its own CA, as a cluster's serving certificate is to the
    service account's ca.crt)."""
    cert, key = directory / "ca.crt", directory / "server.key"
    request = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    subject = ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run([*request, *subject, "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def _fake_api(templates: dict[str, str]) -> tuple[FakeKubernetesApi, list[str]]:
    """The fake API holding the chart's templates, and the Authorization header of every request it gets."""
    api = FakeKubernetesApi()
    api.add(
        "api/v1",
        "configmaps",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": TEMPLATES, "namespace": NAMESPACE, "uid": "t"},
            "data": templates,
        },
    )
    authorizations: list[str] = []

    @api.app.middleware("http")
    async def record_authorization(request: Request, call_next: Any) -> Response:
        authorizations.append(request.headers.get("authorization", ""))
        response: Response = await call_next(request)
        return response

    return api, authorizations


@contextlib.asynccontextmanager
async def _serving(api: FakeKubernetesApi, cert: Path | None = None, key: Path | None = None) -> AsyncIterator[int]:
    """The fake API on a free port (HTTPS when given a certificate); yields the port."""
    ssl = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)} if cert is not None else {}
    config = uvicorn.Config(api.app, host="127.0.0.1", port=0, log_config=None, access_log=False, **ssl)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():  # noqa: ASYNC110 - uvicorn exposes start-up only as a flag
        await asyncio.sleep(0.01)
    if task.done():
        await task
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


def _spec(controller_kit: Any) -> JobSpec:
    body = controller_kit.job_spec_body(num_steps=3)
    body["resources"] = {
        "engines": {"replicas": 1, "kind": "sglang", "gpus_per_replica": 1},
        "rollout_workers": {"replicas": 1},
        "trainer": {"replicas": 1, "gpus_per_replica": 1},
    }
    return JobSpec.model_validate(body)


def _mount_service_account(monkeypatch: pytest.MonkeyPatch, directory: Path, cert: Path, port: int) -> None:
    """What the kubelet gives a pod: the service account's files and the API's address in the environment."""
    (directory / "token").write_text(SERVICE_ACCOUNT_TOKEN)
    (directory / "namespace").write_text(NAMESPACE)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(directory / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(cert))
    monkeypatch.setattr(kubernetes_backend, "_SERVICE_ACCOUNT_NAMESPACE", directory / "namespace")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))


async def test_in_a_pod_the_backend_uses_the_mounted_service_account_over_verified_tls(
    job_templates: dict[str, str],
    controller_kit: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cert, key = _self_signed_certificate(tmp_path)
    api, authorizations = _fake_api(job_templates)
    async with _serving(api, cert, key) as port:
        _mount_service_account(monkeypatch, tmp_path, cert, port)
        settings = controller_kit.make_settings(REDIS_URL, backend="kubernetes", kubernetes_config="auto")
        backend = KubernetesJobBackend.from_settings(settings)
        try:
            assert backend.namespace == NAMESPACE  # from the mounted namespace file: the setting is ""
            await backend.start("jincluster01", _spec(controller_kit))
        finally:
            await backend.close()
    created = api.of_job("jincluster01")
    assert {obj["kind"] for obj in created} >= {"ConfigMap", "Deployment", "StatefulSet"}
    assert {obj["metadata"]["namespace"] for obj in created} == {NAMESPACE}
    assert authorizations and {value.lower() for value in authorizations} == {f"bearer {SERVICE_ACCOUNT_TOKEN}"}


async def test_a_certificate_the_service_account_does_not_vouch_for_is_refused(
    job_templates: dict[str, str],
    controller_kit: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "other").mkdir()
    served_cert, served_key = _self_signed_certificate(tmp_path / "server")
    other_ca, _ = _self_signed_certificate(tmp_path / "other")
    api, authorizations = _fake_api(job_templates)
    async with _serving(api, served_cert, served_key) as port:
        _mount_service_account(monkeypatch, tmp_path, other_ca, port)
        settings = controller_kit.make_settings(REDIS_URL, backend="kubernetes", kubernetes_config="in_cluster")
        backend = KubernetesJobBackend.from_settings(settings)
        try:
            with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
                await backend.templates()
        finally:
            await backend.close()
    assert authorizations == []  # the token never left the controller


async def test_in_cluster_mode_outside_a_pod_says_what_is_missing(
    controller_kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    settings = controller_kit.make_settings(REDIS_URL, backend="kubernetes", kubernetes_config="in_cluster")
    with pytest.raises(ConfigException, match="Service host/port is not set"):
        KubernetesJobBackend.from_settings(settings)


async def test_outside_a_cluster_the_backend_uses_the_kubeconfig_and_the_namespace_setting(
    job_templates: dict[str, str],
    controller_kit: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api, authorizations = _fake_api(job_templates)
    async with _serving(api) as port:
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
            "users: [{name: dev, user: {token: developer-token}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, user: dev}}]\n"
        )
        # The client reads KUBECONFIG when it is imported (as the controller's process does, at start-up).
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # ignored: the setting names the kubeconfig
        settings = controller_kit.make_settings(
            REDIS_URL, backend="kubernetes", kubernetes_config="kubeconfig", kubernetes_namespace=NAMESPACE
        )
        backend = KubernetesJobBackend.from_settings(settings)
        try:
            assert backend.namespace == NAMESPACE
            assert await backend.templates() == job_templates
        finally:
            await backend.close()
    assert authorizations and {value.lower() for value in authorizations} == {"bearer developer-token"}
