"""Kubernetes discovery: engines are the ready endpoints of the EndpointSlices of engine Services.

A daemon thread runs the official (synchronous) `kubernetes` client: list the slices matching
`k8s_label_selector`, then watch from the list's resourceVersion, renewing the watch from the last version seen
when the server ends it; 410 Gone → list again at once; any other error → back off and list again. After each
change it computes the wanted engine URLs per pool — pool from the slice label `k8s_pool_label`, else the
Service name; port named `k8s_port_name`, else the first; endpoints whose `conditions.ready` is false or that
are terminating are left out — and hands them to the event loop, which registers what is new and deregisters
what is gone. Discovery only ever removes engines it added itself (static and admin-registered engines stay).

Limits: one namespace or all; the thread notices a stop request at its next event or watch renewal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from miles.common.errors import ConfigError
from miles.router.settings import RouterSettings

log = logging.getLogger(__name__)

DesiredEngines = dict[str, set[str]]
ApplyFn = Callable[[DesiredEngines], Awaitable[None]]
_SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def desired_engines(slices: Mapping[str, Mapping[str, Any]], settings: RouterSettings) -> DesiredEngines:
    """Wanted engine URLs per pool from EndpointSlice objects (as JSON dicts)."""
    desired: DesiredEngines = {}
    for endpoint_slice in slices.values():
        metadata = endpoint_slice.get("metadata") or {}
        labels = metadata.get("labels") or {}
        pool = labels.get(settings.k8s_pool_label) or labels.get(_SERVICE_NAME_LABEL) or metadata.get("name")
        port = _slice_port(endpoint_slice.get("ports") or [], settings.k8s_port_name)
        if not pool or port is None:
            continue
        urls = desired.setdefault(pool, set())
        for endpoint in endpoint_slice.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            # Kubernetes: a nil ready condition means "unknown" and is to be treated as ready.
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                urls.add(f"{settings.k8s_scheme}://{host}:{port}")
    return desired


def _slice_port(ports: list[Mapping[str, Any]], port_name: str) -> int | None:
    numbers: list[tuple[object, int]] = [
        (port.get("name"), int(port["port"])) for port in ports if isinstance(port.get("port"), int)
    ]
    for name, number in numbers:
        if name == port_name:
            return number
    return numbers[0][1] if numbers else None


class EndpointSliceDiscovery:
    def __init__(self, settings: RouterSettings, apply: ApplyFn, backoff_s: float = 2.0) -> None:
        self.settings = settings
        self.apply = apply
        self.backoff_s = backoff_s
        self.synced = asyncio.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._list_fn, self._list_args = self._api_call()

    def _api_call(self) -> tuple[Callable[..., Any], tuple[str, ...]]:
        """The list function for the configured namespace; fails loudly when no cluster config is found."""
        client, config, _ = _kubernetes()

        if self.settings.k8s_api_url:
            configuration = client.Configuration()
            configuration.host = self.settings.k8s_api_url
            api_client = client.ApiClient(configuration)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                try:
                    config.load_kube_config()
                except (config.ConfigException, OSError) as exc:
                    raise ConfigError(
                        f"k8s_discovery is on but no Kubernetes config was found (in-cluster or kubeconfig): {exc}",
                        field="k8s_discovery",
                    ) from None
            api_client = client.ApiClient()
        api = client.DiscoveryV1Api(api_client)
        if self.settings.k8s_namespace:
            return api.list_namespaced_endpoint_slice, (self.settings.k8s_namespace,)
        return api.list_endpoint_slice_for_all_namespaces, ()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="router-k8s-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        api_exception = _kubernetes()[0].exceptions.ApiException
        slices: dict[str, dict[str, Any]] | None = None
        resource_version = ""
        while not self._stop.is_set():
            try:
                if slices is None:
                    slices, resource_version = self._list()
                    self._publish(slices)
                resource_version = self._watch(slices, resource_version)
            except api_exception as exc:
                slices = None
                if exc.status == 410:
                    log.info("EndpointSlice watch expired; listing again")
                    continue
                log.warning("EndpointSlice discovery failed", extra={"status": exc.status, "reason": exc.reason})
                self._stop.wait(self.backoff_s)
            except Exception:  # any client/network failure: log, back off, list again (never kill the thread)
                slices = None
                log.warning("EndpointSlice discovery failed", exc_info=True)
                self._stop.wait(self.backoff_s)

    def _list(self) -> tuple[dict[str, dict[str, Any]], str]:
        response = self._list_fn(
            *self._list_args, label_selector=self.settings.k8s_label_selector, _preload_content=False
        )
        payload = json.loads(response.data)
        slices = {_slice_key(item): item for item in payload.get("items") or []}
        return slices, str((payload.get("metadata") or {}).get("resourceVersion", ""))

    def _watch(self, slices: dict[str, dict[str, Any]], resource_version: str) -> str:
        """Apply watch events until the server ends the watch; returns the last resourceVersion seen."""
        watcher = _kubernetes()[2].Watch()
        stream = watcher.stream(
            self._list_fn,
            *self._list_args,
            label_selector=self.settings.k8s_label_selector,
            resource_version=resource_version,
            timeout_seconds=self.settings.k8s_watch_timeout_s,
            allow_watch_bookmarks=True,
            deserialize=False,
        )
        for event in stream:
            if self._stop.is_set():
                watcher.stop()
                break
            kind, obj = event.get("type"), event.get("object") or {}
            resource_version = str((obj.get("metadata") or {}).get("resourceVersion") or resource_version)
            if kind in ("ADDED", "MODIFIED"):
                slices[_slice_key(obj)] = obj
            elif kind == "DELETED":
                slices.pop(_slice_key(obj), None)
            else:
                continue
            self._publish(slices)
        return resource_version

    def _publish(self, slices: Mapping[str, Mapping[str, Any]]) -> None:
        desired = desired_engines(slices, self.settings)
        loop = self._loop
        if loop is None or loop.is_closed() or self._stop.is_set():
            return
        future = asyncio.run_coroutine_threadsafe(self._apply_and_mark(desired), loop)
        future.result()  # apply in order; an exception propagates into the retry loop

    async def _apply_and_mark(self, desired: DesiredEngines) -> None:
        await self.apply(desired)
        self.synced.set()


def _kubernetes() -> tuple[Any, Any, Any]:
    """The kubernetes client modules (client, config, watch), imported on first use; typed Any (no stubs)."""
    from kubernetes import client, config, watch

    return client, config, watch


def _slice_key(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata") or {}
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"
