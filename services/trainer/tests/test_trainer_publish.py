"""Honest versions: what the trainer publishes at start-up (`resume`) and after each step, against a recording
receiver and against a real weight-sync origin (in-process core, real gRPC socket, memory:// store).

Pinned: version 0 is the initial weights; a restart at the receiver's latest version republishes it (already
stored, nothing changes); a restart from an older checkpoint never reuses a number — the restored weights become
the next version and the ones in between are superseded (in the ledger and in weight-sync's GetVersion); a
publisher that pushes into engines counts intents as used numbers; a receiver behind the trainer is an error;
retryable failures are retried and non-retryable ones are not; every digest the trainer records is the one the
receiver stored.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from miles.common.errors import InvalidArgumentError, UnavailableError
from miles.common.grpc_server import build_grpc_server
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics
from miles.trainer.errors import PublishStateError
from miles.trainer.publish import WeightPublisher, digest_of
from miles.trainer.publish_ledger import PublishLedger, SupersededRange, VersionRecord
from miles.trainer.publish_stream import StreamPublisher
from miles.trainer.settings import PublishSettings, TrainerSettings


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(64, 8, generator=generator), "model.norm.weight": torch.ones(8)}


class RecordingPublisher(WeightPublisher):
    """Receives into a dict (version -> digest) like a store; `fail` makes the next sends raise."""

    def __init__(self, ledger: PublishLedger, *, pushes_directly: bool = False, has_store: bool = True) -> None:
        super().__init__(ledger, dtype="float32", retry_timeout_s=5.0)
        self.pushes_directly = pushes_directly
        self.has_store = has_store
        self.received: dict[int, str] = {}
        self.fail: list[Exception] = []

    async def _receiver_latest(self) -> int:
        return max(self.received, default=-1) if self.has_store else -1

    async def _send(
        self, record: VersionRecord, tensors: dict[str, torch.Tensor], *, step_finished_unix_ms: int
    ) -> VersionRecord:
        if self.fail:
            raise self.fail.pop(0)
        already = self.received.get(record.version) == record.weights_digest
        self.received[record.version] = record.weights_digest
        return VersionRecord(**{**record.__dict__, "already_published": already})


async def test_a_new_job_publishes_its_initial_weights_as_version_0(tmp_path: Path) -> None:
    publisher = RecordingPublisher(PublishLedger(tmp_path))
    record = await publisher.resume(0, weights(0), step=0)
    assert (record.version, record.parent_version, record.restored_from_version) == (0, -1, None)
    assert publisher.received == {0: digest_of(weights(0))}
    step = await publisher.publish(1, weights(1), step=1, step_finished_unix_ms=1)
    assert (step.version, step.parent_version) == (1, 0)


async def test_restart_at_the_latest_version_republishes_it_unchanged(tmp_path: Path) -> None:
    publisher = RecordingPublisher(PublishLedger(tmp_path))
    for version in range(3):
        await publisher.publish(version, weights(version), step=version, step_finished_unix_ms=0)
    restarted = RecordingPublisher(PublishLedger(tmp_path))
    restarted.received = dict(publisher.received)
    record = await restarted.resume(2, weights(2), step=2)
    assert (record.version, record.already_published) == (2, True)
    assert restarted.superseded == []


async def test_restart_from_an_older_checkpoint_supersedes_instead_of_reusing_numbers(tmp_path: Path) -> None:
    dead = RecordingPublisher(PublishLedger(tmp_path))
    for version in range(5):  # the dead trainer published 0..4; its last durable checkpoint was version 2
        await dead.publish(version, weights(version), step=version, step_finished_unix_ms=0)
    restarted = RecordingPublisher(PublishLedger(tmp_path))
    restarted.received = dict(dead.received)
    record = await restarted.resume(2, weights(2), step=2)
    assert (record.version, record.parent_version, record.restored_from_version) == (5, 4, 2)
    assert restarted.received[5] == restarted.received[2] == digest_of(weights(2))
    assert restarted.superseded == [SupersededRange(3, 4, 5)]
    assert 3 in restarted.superseded[0] and 5 not in restarted.superseded[0]
    digests: dict[int, set[str]] = {}
    for entry in PublishLedger(tmp_path).records():
        digests.setdefault(entry.version, set()).add(entry.weights_digest)
    assert all(len(found) == 1 for found in digests.values()), "a version number carried two contents"


async def test_a_publisher_pushing_into_engines_counts_intents_as_used_numbers(tmp_path: Path) -> None:
    ledger = PublishLedger(tmp_path)
    ledger.intent(VersionRecord(3, 2, 3, "x" * 64))  # the dead trainer may have reached an engine with version 3
    publisher = RecordingPublisher(ledger, pushes_directly=True, has_store=False)
    record = await publisher.resume(2, weights(2), step=2)
    assert (record.version, record.restored_from_version) == (4, 2)


async def test_a_receiver_behind_the_trainer_is_refused(tmp_path: Path) -> None:
    publisher = RecordingPublisher(PublishLedger(tmp_path))
    publisher.received = {0: "a" * 64}
    with pytest.raises(PublishStateError, match="never published there"):
        await publisher.resume(3, weights(3), step=3)


async def test_retryable_failures_are_retried_and_others_are_not(tmp_path: Path) -> None:
    publisher = RecordingPublisher(PublishLedger(tmp_path))
    publisher.fail = [UnavailableError("origin restarting"), UnavailableError("origin restarting")]
    record = await publisher.publish(0, weights(0), step=0, step_finished_unix_ms=0)
    assert record.version == 0 and publisher.take_failures() == 2
    publisher.fail = [InvalidArgumentError("bad header")]
    with pytest.raises(InvalidArgumentError):
        await publisher.publish(1, weights(1), step=1, step_finished_unix_ms=0)
    assert [r.version for r in PublishLedger(tmp_path).records()] == [0]


@pytest.fixture
async def origin() -> AsyncIterator[str]:
    from miles.weightsync.core import WeightSyncCore
    from miles.weightsync.grpc_api import SERVICE_NAME, WeightSyncServicer, add_servicer
    from miles.weightsync.settings import WeightsyncSettings

    settings = load_settings(
        WeightsyncSettings, job_id="job-t", store_url=f"memory://trainer-publish-{uuid.uuid4().hex}", auto_update=False
    )
    metrics = Metrics("weightsync")
    core = WeightSyncCore(settings, metrics)
    server = build_grpc_server(
        servicers=[(add_servicer, WeightSyncServicer(core))], service_names=[SERVICE_NAME], metrics=metrics
    )
    await server.start()
    yield f"127.0.0.1:{server.port}"
    await server.stop(0)
    await core.close()


def stream_settings(tmp_path: Path, address: str) -> TrainerSettings:
    return TrainerSettings(
        job_id="job-t",
        model_path=tmp_path,
        checkpoint_dir=tmp_path / "ckpt",
        publish=PublishSettings(weightsync_address=address),
    )


async def test_stream_publisher_against_a_real_origin_rewinds_after_a_crash(tmp_path: Path, origin: str) -> None:
    from miles.weightsync.client import WeightSyncClient

    settings = stream_settings(tmp_path, origin)
    dead = StreamPublisher(settings, PublishLedger(tmp_path / "ckpt"))
    assert (await dead.resume(0, weights(0), step=0)).version == 0
    for version in (1, 2, 3):
        await dead.publish(version, weights(version), step=version, step_finished_unix_ms=1)
    await dead.close()

    same = StreamPublisher(settings, PublishLedger(tmp_path / "ckpt"))
    assert (await same.resume(3, weights(3), step=3)).already_published
    await same.close()

    restarted = StreamPublisher(settings, PublishLedger(tmp_path / "ckpt"))
    record = await restarted.resume(1, weights(1), step=1)
    assert (record.version, record.restored_from_version, record.already_published) == (4, 1, False)
    await restarted.publish(5, weights(10), step=2, step_finished_unix_ms=1)
    await restarted.close()

    async with WeightSyncClient(origin) as client:
        status = await client.get_version("job-t")
        fetched_4 = await client.fetch_weights("job-t", 4)
    assert status.latest_version == 5 and list(status.stored_versions) == [0, 1, 2, 3, 4, 5]
    assert [(r.first_version, r.last_version, r.by_version) for r in status.superseded] == [(2, 3, 4)]
    assert status.latest_weights_digest == digest_of({n: t.to(torch.bfloat16) for n, t in weights(10).items()})
    bf16_1 = {n: t.to(torch.bfloat16) for n, t in weights(1).items()}
    assert {n: bytes(raw) for n, raw in fetched_4.data.items()} == {
        n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in bf16_1.items()
    }
    recorded = {(r.version, r.weights_digest) for r in PublishLedger(tmp_path / "ckpt").records()}
    assert (4, digest_of(bf16_1)) in recorded
    assert len({version for version, _ in recorded}) == len(recorded), "a version number carried two contents"


def adapter_settings(tmp_path: Path, **publish: object) -> TrainerSettings:
    return TrainerSettings.model_validate(
        {
            "job_id": "lora-job",
            "model_path": str(tmp_path),
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "train": {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]}},
            "publish": {"kind": "adapter", **publish},
        }
    )


def test_adapter_publishing_needs_the_pool_and_the_session_server(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"publish\.session_url"):
        adapter_settings(tmp_path, router_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"router_url or publish\.engine_urls"):
        adapter_settings(tmp_path, session_url="http://127.0.0.1:2")
    settings = adapter_settings(tmp_path, router_url="http://127.0.0.1:1", session_url="http://127.0.0.1:2")
    from miles.trainer.publish import make_publisher

    publisher = make_publisher(settings)
    assert publisher.ships_adapters and publisher.pushes_directly
    assert publisher.path_for(7).name == "adapter-v000007"  # type: ignore[attr-defined]


def test_published_version_dirs_keep_the_newest_up_to_the_one_just_published(tmp_path: Path) -> None:
    from miles.trainer.publish_ledger import prune_version_dirs

    for name in [*(f"adapter-v{v:06d}" for v in (1, 2, 3, 4, 5, 9)), "adapter-vtmp", "weights-v000001"]:
        (tmp_path / name).mkdir()
    prune_version_dirs(tmp_path, "adapter-v", newest=5, keep_last=2)
    left = sorted(path.name for path in tmp_path.iterdir())  # 9 is ahead of 5 (a resumed run): not this call's
    assert left == ["adapter-v000004", "adapter-v000005", "adapter-v000009", "adapter-vtmp", "weights-v000001"]
