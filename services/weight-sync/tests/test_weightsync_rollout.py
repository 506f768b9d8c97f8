"""End to end with real processes: 2 miles-engine processes behind a real miles-rollout-router, the origin
weight-sync daemon (engine A next to it, the trainer publishes to it) and a peer daemon next to engine B with its
own store (sidecar topology: versions replicate from the origin), a trainer-like client taking real AdamW steps
of the tiny model, a reference engine loaded from each version's full checkpoint, and a load generator sending
requests through the router the whole time.

For every transport (disk, delta, stream) five versions are published and rolled out; after each, both engines
report the version and their greedy outputs and logprobs equal, bit for bit, the reference engine's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from weightsync_testkit import (
    Proc,
    TinyTrainer,
    engine_version,
    greedy,
    start_daemon,
    start_engine,
    start_router,
    stop_all,
    wait_ready,
)

from miles.common.errors import FailedPreconditionError, InvalidArgumentError
from miles.common.testing import free_port
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.weightsync.client import WeightSyncClient

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

JOB = "job-ws"
PROMPT = [9707, 11, 1879, 374, 264, 1273, 315, 279, 4628, 1849]


class LoadGenerator:
    """Sends short requests through the router in a loop (~20/s at most) and records answers that are not 200."""

    def __init__(self, router_url: str) -> None:
        self.router_url = router_url
        self.num_ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.router_url, timeout=120.0) as client:
            index = 0
            while not self._stop.is_set():
                index += 1
                body = {"input_ids": [100 + index % 50, 200, 300], "sampling_params": {"max_new_tokens": 2}}
                try:
                    response = client.post("/generate", json=body)
                    if response.status_code == 200:
                        self.num_ok += 1
                    else:
                        self.failures.append(f"HTTP {response.status_code}: {response.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self._stop.wait(0.05)  # steady traffic without starving the 2-core test machine

    def start(self) -> LoadGenerator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@dataclass
class Cluster:
    engines: list[Proc]
    reference: Proc
    router: Proc
    origin: Proc
    peer: Proc
    trainer: TinyTrainer
    load: LoadGenerator
    work_dir: Path
    origin_store: Path
    peer_store: Path
    published: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("ws-e2e")
    logs = root / "logs"
    logs.mkdir()
    engines = [start_engine(tiny_model_dir, logs, "--deterministic") for _ in range(2)]
    reference = start_engine(tiny_model_dir, logs, "--deterministic")
    router = start_router([e.url for e in engines], logs)
    common = {
        "job_id": JOB,
        "router_url": router.url,
        "snapshot_interval": 4,
        "retain_versions": 6,
        "auto_update": False,
        "model_config_dir": str(tiny_model_dir),
        "engine_timeout_s": 120,
        "fetch_streams": 2,
        "shutdown_grace_s": 1,
    }
    origin_port, peer_port = free_port(), free_port()
    procs: list[Proc] = [*engines, reference, router]
    try:
        wait_ready([router], "/readyz")
        origin = start_daemon(
            {
                **common,
                "engine_urls": [engines[0].url],
                "store_dir": str(root / "store-a"),
                "work_dir": str(root / "work-a"),
                "peers": [f"127.0.0.1:{peer_port}"],
            },
            logs,
            "origin",
            origin_port,
        )
        procs.append(origin)
        peer = start_daemon(
            {
                **common,
                "engine_urls": [engines[1].url],
                "store_dir": str(root / "store-b"),
                "work_dir": str(root / "work-b"),
                "origin": origin.address,
            },
            logs,
            "peer",
            peer_port,
        )
        procs.append(peer)
        wait_ready([*engines, reference], "/readyz")
        wait_ready([origin, peer], "/readyz")
        _wait_router_healthy(router.url, 2)
        trainer = TinyTrainer(tiny_model_dir, lr=1e-4)
        load = LoadGenerator(router.url).start()
        yield Cluster(engines, reference, router, origin, peer, trainer, load, root, root / "store-a", root / "store-b")
        load.stop()
    finally:
        stop_all(procs)


def _wait_router_healthy(router_url: str, num_engines: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        engines = httpx.get(f"{router_url}/admin/v1/engines").json()["engines"]
        if sum(e["state"] == "healthy" for e in engines) == num_engines:
            return
        time.sleep(0.2)
    raise AssertionError(f"router engines not healthy: {engines}")


def _router_states(router_url: str) -> dict[str, str]:
    return {e["url"]: e["state"] for e in httpx.get(f"{router_url}/admin/v1/engines").json()["engines"]}


def _load_from_disk(engine_url: str, checkpoint: Path, version: int) -> None:
    body = {"model_path": str(checkpoint), "weight_version": str(version)}
    loaded = httpx.post(f"{engine_url}/update_weights_from_disk", json=body, timeout=120.0)
    assert loaded.status_code == 200 and loaded.json()["success"], loaded.text


def _metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series (matching the given labels) from /metrics."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30.0).text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        if all(f'{key}="{val}"' in series for key, val in labels.items()):
            total += float(value)
    return total


async def _publish_next(cluster: Cluster, client: WeightSyncClient):  # type: ignore[no-untyped-def]
    trainer = cluster.trainer
    version = trainer.step() if cluster.published else 0
    result = await client.publish(JOB, version, version - 1, trainer.bf16_state())
    assert result.version == version
    cluster.published.append(version)
    return result


async def _roll_out_and_check(
    cluster: Cluster, client: WeightSyncClient, version: int, transport: str, pause_mode: str = "drain"
) -> pb.UpdateEnginesResponse:
    response = await client.update_engines(JOB, version, transport=transport, pause_mode=pause_mode)
    assert response.num_failed == 0, response
    assert sorted(e.engine_url for e in response.engines) == sorted(e.url for e in cluster.engines)
    assert all(e.weight_version == version for e in response.engines), response
    checkpoint = cluster.trainer.write_checkpoint(cluster.work_dir / "checkpoints" / f"v{version}")
    _load_from_disk(cluster.reference.url, checkpoint, version)
    expected = greedy(cluster.reference.url, PROMPT)
    assert expected["weight_version"] == str(version)
    for engine in cluster.engines:
        assert engine_version(engine.url) == str(version)
        assert greedy(engine.url, PROMPT) == expected, f"{engine.url} differs from the full checkpoint of v{version}"
    return response


async def _ensure_initial_version(cluster: Cluster, client: WeightSyncClient) -> None:
    if not cluster.published:
        result = await _publish_next(cluster, client)
        assert result.is_snapshot
        await _roll_out_and_check(cluster, client, 0, "delta")  # no local copy yet: a full load


@pytest.mark.parametrize(("transport", "pause_mode"), [("disk", "drain"), ("delta", "drain"), ("stream", "retract")])
async def test_five_versions_reach_every_engine_bit_exact(cluster: Cluster, transport: str, pause_mode: str) -> None:
    async with WeightSyncClient(cluster.origin.address) as client:
        await _ensure_initial_version(cluster, client)
        ok_before = cluster.load.num_ok
        delta_loads_before = [
            _metric(d.url, "miles_weightsync_engine_updates_total", outcome="delta")
            for d in (cluster.origin, cluster.peer)
        ]
        data_channel_before = _metric(cluster.peer.url, "miles_weightsync_full_fetches_total", path="data_channel")
        previous = greedy(cluster.engines[0].url, PROMPT)
        for _ in range(5):
            result = await _publish_next(cluster, client)
            if not result.is_snapshot:
                assert result.stored_bytes < result.full_bytes
            response = await _roll_out_and_check(cluster, client, result.version, transport, pause_mode)
            assert response.num_fallbacks == 0
            current = greedy(cluster.engines[0].url, PROMPT)
            assert current["logprobs"] != previous["logprobs"], "the step should change the model's outputs"
            previous = current
    delta_loads = [
        _metric(d.url, "miles_weightsync_engine_updates_total", outcome="delta") for d in (cluster.origin, cluster.peer)
    ]
    if transport == "delta":
        assert [after - before for after, before in zip(delta_loads, delta_loads_before, strict=True)] == [5, 5]
    if transport == "stream":  # the peer's full loads came over the origin's raw TCP data channel
        data_channel = _metric(cluster.peer.url, "miles_weightsync_full_fetches_total", path="data_channel")
        assert data_channel - data_channel_before == 5
    assert cluster.load.failures == []
    assert cluster.load.num_ok > ok_before, "requests kept being served during the rolling updates"


async def test_corrupted_delta_is_detected_and_falls_back_to_full_load(cluster: Cluster) -> None:
    async with WeightSyncClient(cluster.origin.address) as client:
        await _ensure_initial_version(cluster, client)
        result = await _publish_next(cluster, client)
        if result.is_snapshot:
            result = await _publish_next(cluster, client)
        manifest = (cluster.origin_store / JOB / "versions" / f"{result.version:012d}.json").read_text()
        blob_sha256 = _largest_delta_blob(manifest)
        blob_path = cluster.origin_store / JOB / "objects" / blob_sha256[:2] / blob_sha256
        corrupted = bytearray(blob_path.read_bytes())
        corrupted[len(corrupted) // 2] ^= 0xFF
        blob_path.write_bytes(bytes(corrupted))
        fallbacks_before = _metric(cluster.origin.url, "miles_weightsync_fallbacks_total")
        response = await _roll_out_and_check(cluster, client, result.version, "delta")
    assert response.num_fallbacks == 2, response
    assert all(e.fell_back for e in response.engines)
    assert _metric(cluster.origin.url, "miles_weightsync_fallbacks_total") == fallbacks_before + 1
    assert _metric(cluster.peer.url, "miles_weightsync_fallbacks_total") >= 1
    assert cluster.load.failures == []


def _largest_delta_blob(manifest_json: str) -> str:
    import json

    tensors = [t for t in json.loads(manifest_json)["tensors"] if t["encoding"] != "zstd" and t["num_changed"] > 0]
    return str(max(tensors, key=lambda t: t["stored_bytes"])["blob_sha256"])


def _store_listing(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def _engine_state(cluster: Cluster) -> list[tuple[str, float]]:
    return [(engine_version(e.url), _metric(e.url, "miles_engine_weight_updates_total")) for e in cluster.engines]


async def test_bad_publishes_are_rejected_without_touching_store_or_engines(cluster: Cluster) -> None:
    from miles.weightsync.client import tensor_bytes
    from miles.weightsync.manifest import TensorSpec
    from miles.weightsync.wire import weights_chunks

    async with WeightSyncClient(cluster.origin.address) as client:
        await _ensure_initial_version(cluster, client)
        latest = cluster.published[-1]
        stores = [_store_listing(cluster.origin_store), _store_listing(cluster.peer_store)]
        engines = _engine_state(cluster)
        state = cluster.trainer.bf16_state()

        again = await client.publish(JOB, latest, latest - 1, state)  # the same version again: idempotent
        assert again.already_stored and again.version == latest and again.stored_bytes > 0
        other = {**state, "model.norm.weight": state["model.norm.weight"] + 1}
        with pytest.raises(FailedPreconditionError, match="already stored with other weights"):
            await client.publish(JOB, latest, latest - 1, other)  # a number never carries two contents
        with pytest.raises(FailedPreconditionError, match="a gap"):
            await client.publish(JOB, latest + 2, latest + 1, state)
        with pytest.raises(InvalidArgumentError, match="parent_version \\+ 1"):
            await client.publish(JOB, latest + 3, latest, state)
        with pytest.raises(InvalidArgumentError, match="restored_from_version"):
            await client.publish(JOB, latest + 1, latest, state, restored_from_version=latest)
        reshaped = {**state, "model.norm.weight": state["model.norm.weight"][:-1]}
        with pytest.raises(InvalidArgumentError, match="shape"):
            await client.publish(JOB, latest + 1, latest, reshaped)
        with pytest.raises(InvalidArgumentError, match="dtype"):
            await client.publish(JOB, latest + 1, latest, state, dtype="float32")

        # Raw streams: a truncated one (no commit, last tensor cut short) and one with a flipped byte.
        names = list(state)
        data = {name: tensor_bytes(t, None).tobytes() for name, t in state.items()}
        specs = [TensorSpec(n, "bfloat16", tuple(state[n].shape), _sha256(data[n])) for n in names]
        messages = list(weights_chunks(JOB, latest + 1, latest, specs, data, 1 << 20))
        wrong_commit = [*messages[:-1], pb.PublishWeightsChunk(commit=pb.PublishCommit(manifest_sha256="0" * 64))]
        for broken in (messages[:-2], _flip_first_chunk(messages), wrong_commit):
            with pytest.raises(InvalidArgumentError, match=r"truncated|sha256"):
                await _raw_publish(client, broken)

    assert _store_listing(cluster.origin_store) == stores[0]
    assert _store_listing(cluster.peer_store) == stores[1]
    assert _engine_state(cluster) == engines
    routed = _router_states(cluster.router.url)
    assert all(state == "healthy" for state in routed.values()), routed
    assert _metric(cluster.origin.url, "miles_weightsync_publishes_total", outcome="rejected") >= 9


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _flip_first_chunk(messages: list[pb.PublishWeightsChunk]) -> list[pb.PublishWeightsChunk]:
    flipped = list(messages)
    chunk = pb.PublishWeightsChunk()
    chunk.CopyFrom(flipped[1])
    data = bytearray(chunk.chunk.data)
    data[0] ^= 1
    chunk.chunk.data = bytes(data)
    flipped[1] = chunk
    return flipped


async def _raw_publish(client: WeightSyncClient, messages: list[pb.PublishWeightsChunk]) -> None:
    import grpc

    from miles.common.grpc_client import error_from_rpc_error

    async def requests() -> AsyncIterator[pb.PublishWeightsChunk]:
        for message in messages:
            yield message

    try:
        await client._stub.PublishWeights(requests())
    except grpc.aio.AioRpcError as exc:
        raise error_from_rpc_error(exc) from exc


async def test_watch_versions_and_get_version_report_every_engine(cluster: Cluster) -> None:
    async with WeightSyncClient(cluster.origin.address) as client:
        await _ensure_initial_version(cluster, client)
        next_version = cluster.published[-1] + 1
        events: list[pb.VersionEvent] = []

        async def watch() -> None:
            async for event in client.watch_versions(JOB, from_version=next_version):
                events.append(event)
                if event.kind == pb.VERSION_EVENT_KIND_ROLLOUT_COMPLETE:
                    return

        watcher = asyncio.create_task(watch())
        result = await _publish_next(cluster, client)
        await _roll_out_and_check(cluster, client, result.version, "delta")
        await asyncio.wait_for(watcher, 60)
        status = await client.get_version(JOB)

    kinds = [(e.kind, e.engine_url) for e in events]
    assert kinds[0] == (pb.VERSION_EVENT_KIND_STORED, "")
    assert sorted(url for kind, url in kinds if kind == pb.VERSION_EVENT_KIND_ENGINE_UPDATED) == sorted(
        e.url for e in cluster.engines
    )
    assert events[0].full_bytes > events[0].stored_bytes > 0
    assert status.latest_version == result.version
    by_url = {e.engine_url: e for e in status.engines}
    assert by_url[cluster.engines[0].url].daemon == ""
    assert by_url[cluster.engines[1].url].daemon == cluster.peer.address
    assert all(e.weight_version == result.version and not e.update_failed for e in status.engines)
    assert list(status.stored_versions) == sorted(status.stored_versions)
    assert status.stored_versions[-1] == result.version and len(status.stored_versions) <= 6 + 4
    assert _metric(cluster.origin.url, "miles_weightsync_engine_version_skew") == 0


async def test_failed_update_leaves_engine_drained_and_reported(cluster: Cluster) -> None:
    """Runs last: it kills engine B."""
    async with WeightSyncClient(cluster.origin.address) as client:
        await _ensure_initial_version(cluster, client)
        cluster.load.stop()
        cluster.engines[1].process.kill9()
        result = await _publish_next(cluster, client)
        response = await client.update_engines(JOB, result.version, transport="delta", engine_timeout_s=60)
        status = await client.get_version(JOB)
    by_url = {e.engine_url: e for e in response.engines}
    assert not by_url[cluster.engines[0].url].update_failed
    assert engine_version(cluster.engines[0].url) == str(result.version)
    failed = by_url[cluster.engines[1].url]
    assert failed.update_failed and failed.error
    assert response.num_failed == 1
    routed = _router_states(cluster.router.url)
    assert routed[cluster.engines[1].url] in ("draining", "drained")
    assert routed[cluster.engines[0].url] == "healthy"
    assert {e.engine_url: e.update_failed for e in status.engines}[cluster.engines[1].url]
