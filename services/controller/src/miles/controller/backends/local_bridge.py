"""Per-job process of the local backend that carries the trainer's weight versions to the job's weight-sync origin.

The trainer's publisher writes every version as an HF directory `<publish_dir>/weights-v000007/`; weight-sync
only takes versions through `PublishWeights`. This process polls the directory and publishes each new version, in
order (weight-sync requires `version = parent + 1`), so the origin stores it and rolls it out to the engines with
the job's transport.

It also heals engines left behind: an engine that reports a version older than the store's latest (or a failed
update) for `catch_up_after_s` — one that joined in a resize, or whose update was cut short by a weight-sync
restart — is asked to load the latest version (`UpdateEngines` for that engine only).

Limits: a version whose directory is already gone (the trainer keeps the last few) is published with the weights
of the next version that still exists, so its number keeps the sequence but not its exact weights. A version
number published again after a trainer restart (same number, retrained weights) is skipped: the store keeps the
first. Run: `python -m miles.controller.backends.local_bridge --job-id J --publish-dir D --weightsync-address A`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import time
from pathlib import Path
from typing import Any

from miles.common.aio import wait_event

log = logging.getLogger("miles.controller.local_bridge")
VERSION_DIR = re.compile(r"^weights-v(\d+)$")


def published_versions(publish_dir: Path) -> dict[int, Path]:
    """Complete version directories (the trainer renames them into place when done) by version."""
    found: dict[int, Path] = {}
    if not publish_dir.is_dir():
        return found
    for path in publish_dir.iterdir():
        match = VERSION_DIR.match(path.name)
        if match and (path / "model.safetensors").is_file():
            found[int(match.group(1))] = path
    return found


def plan_publishes(latest_stored: int, available: dict[int, Path]) -> list[tuple[int, Path]]:
    """(version, directory) pairs to publish after `latest_stored`, in order, filling gaps with the next version
    that still exists."""
    if not available:
        return []
    newest = max(available)
    plan = []
    for version in range(latest_stored + 1, newest + 1):
        source = min(v for v in available if v >= version)
        plan.append((version, available[source]))
    return plan


class Bridge:
    def __init__(self, job_id: str, publish_dir: Path, client: Any, *, catch_up_after_s: float) -> None:
        self.job_id = job_id
        self.publish_dir = publish_dir
        self.client = client
        self.catch_up_after_s = catch_up_after_s
        self._behind_since: dict[str, float] = {}

    async def publish_new(self, latest: int) -> int:
        from safetensors.torch import load_file

        for version, path in plan_publishes(latest, published_versions(self.publish_dir)):
            tensors = await asyncio.to_thread(load_file, str(path / "model.safetensors"))
            result = await self.client.publish(
                self.job_id, version=version, parent_version=version - 1, named_tensors=tensors
            )
            log.info("published version %d from %s (stored %d bytes)", version, path.name, result.stored_bytes)
            latest = version
        return latest

    async def catch_up(self, status: Any) -> None:
        latest = int(status.latest_version)
        now = time.monotonic()
        behind = [e.engine_url for e in status.engines if e.update_failed or 0 <= e.weight_version < latest]
        for url in list(self._behind_since):
            if url not in behind:
                del self._behind_since[url]
        due = []
        for url in behind:
            since = self._behind_since.setdefault(url, now)
            if now - since >= self.catch_up_after_s:
                due.append(url)
        if latest < 0 or not due:
            return
        log.info("engines behind version %d: %s", latest, due)
        response = await self.client.update_engines(self.job_id, latest, engine_urls=due)
        log.info("catch-up of %s done: %s", due, str(response).replace("\n", " ")[:500])
        for url in due:
            self._behind_since.pop(url, None)

    async def run_once(self) -> None:
        status = await self.client.get_version(self.job_id)
        latest = await self.publish_new(int(status.latest_version))
        if latest == int(status.latest_version):
            await self.catch_up(status)


async def run(args: argparse.Namespace) -> None:
    from miles.weightsync.client import WeightSyncClient

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with WeightSyncClient(args.weightsync_address) as client:
        bridge = Bridge(args.job_id, Path(args.publish_dir), client, catch_up_after_s=args.catch_up_after_s)
        while not stop.is_set():
            try:
                await bridge.run_once()
            except Exception as exc:  # the daemon may be restarting; a directory may vanish: try again
                log.warning("bridge pass failed: %s: %s", type(exc).__name__, exc)
            await wait_event(stop, args.poll_interval_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="local_bridge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--publish-dir", required=True)
    parser.add_argument("--weightsync-address", required=True)
    parser.add_argument("--poll-interval-s", type=float, default=0.5)
    parser.add_argument("--catch-up-after-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
