"""The `stream` publisher: each version from the trainer's memory to the job's weight-sync origin.

The weight-sync client (a library of the trainer; the service runs elsewhere) sends the version's tensors in the
publish dtype — over the origin's raw TCP data channel when it offers one, else the gRPC stream — with the time
the trainer step finished (the start of the version's step-to-serving latency). The origin checks every tensor
against its checksum, stores the version (a lossless delta against its parent) and rolls it out to the engines;
nothing goes through disk on the trainer side. The origin's answer carries the version's weights digest, which
must equal the trainer's own (else the publish fails: something between them changed the bytes).

Every call carries `weightsync_auth_token` (weight-sync's auth_token): a refused token fails the publish at once
(PermissionDeniedError / UnauthenticatedError are not retryable), so the trainer stops with that reason instead of
retrying for `publish.retry_timeout_s`.

On a restart the store's latest version decides between republishing the restored version (the store answers
"already stored") and superseding what a dead predecessor published (`WeightPublisher.resume`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.trainer.errors import PublishDigestMismatchError
from miles.trainer.publish import WeightPublisher
from miles.trainer.publish_ledger import PublishLedger, VersionRecord

if TYPE_CHECKING:
    import torch

    from miles.trainer.settings import TrainerSettings
    from miles.weightsync.client import WeightSyncClient


class StreamPublisher(WeightPublisher):
    has_store = True

    def __init__(self, settings: TrainerSettings, ledger: PublishLedger) -> None:
        publish = settings.publish
        super().__init__(ledger, dtype=publish.dtype, retry_timeout_s=publish.retry_timeout_s)
        if not publish.weightsync_address:
            raise ValueError("publish.kind 'stream' needs publish.weightsync_address (the job's weight-sync origin)")
        self.address = publish.weightsync_address
        self.auth_token = settings.weightsync_auth_token.get_secret_value()
        self.job_id = settings.job_id
        self._client: WeightSyncClient | None = None

    def client(self) -> WeightSyncClient:
        if self._client is None:
            from miles.weightsync.client import WeightSyncClient

            self._client = WeightSyncClient(self.address, auth_token=self.auth_token)
        return self._client

    async def _receiver_latest(self) -> int:
        return int((await self.client().get_version(self.job_id)).latest_version)

    async def _send(
        self, record: VersionRecord, tensors: dict[str, torch.Tensor], *, step_finished_unix_ms: int
    ) -> VersionRecord:
        result = await self.client().publish(
            self.job_id,
            record.version,
            record.parent_version,
            tensors,
            dtype=None,
            step_finished_unix_ms=step_finished_unix_ms,
            restored_from_version=record.restored_from_version,
        )
        if result.weights_digest != record.weights_digest:
            raise PublishDigestMismatchError(
                f"weight-sync stored version {record.version} with digest {result.weights_digest[:16]}..., the "
                f"trainer computed {record.weights_digest[:16]}..."
            )
        return VersionRecord(
            **{**record.__dict__, "num_bytes": result.full_bytes, "already_published": result.already_stored}
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
