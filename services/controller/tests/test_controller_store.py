"""The job state machine, the Redis job store (real Redis) and the job spec's own checks."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import ValidationError

from miles.common.errors import ConfigError
from miles.common.jobspec.job import JobSpec
from miles.common.settings import load_settings
from miles.controller.errors import IllegalTransitionError, JobNotFoundError, JobStateConflictError
from miles.controller.jobs import LEGAL_TRANSITIONS, JobRecord, JobState, is_legal_transition, new_job_id
from miles.controller.settings import ControllerSettings
from miles.controller.store import JobStore


def test_state_machine_allows_only_the_documented_transitions() -> None:
    allowed = {(a, b) for a in JobState for b in JobState if is_legal_transition(a, b)}
    assert allowed == {
        (JobState.PENDING, JobState.RUNNING),
        (JobState.PENDING, JobState.FAILED),
        (JobState.PENDING, JobState.CANCELLED),
        (JobState.RUNNING, JobState.SUCCEEDED),
        (JobState.RUNNING, JobState.FAILED),
        (JobState.RUNNING, JobState.CANCELLED),
        # Kueue admission (spec.kueue): queued until admitted, back to QUEUED when preempted.
        (JobState.PENDING, JobState.QUEUED),
        (JobState.QUEUED, JobState.RUNNING),
        (JobState.QUEUED, JobState.SUCCEEDED),
        (JobState.QUEUED, JobState.FAILED),
        (JobState.QUEUED, JobState.CANCELLED),
        (JobState.RUNNING, JobState.QUEUED),
    }
    assert all(not LEGAL_TRANSITIONS[state] for state in JobState if state.is_terminal)


def test_job_ids_are_short_dns_labels() -> None:
    ids = {new_job_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(job_id) <= 20 and job_id.isalnum() and job_id.islower() for job_id in ids)


def _record(spec_body: dict[str, Any]) -> JobRecord:
    now = time.time()
    return JobRecord(new_job_id(), JobSpec.model_validate(spec_body), JobState.PENDING, now, now)


@pytest.mark.integration
async def test_store_refuses_illegal_transitions_and_deleting_active_jobs(redis_url: str, controller_kit: Any) -> None:
    store = JobStore(redis_url, key_prefix="t", max_events=100)
    try:
        record = _record(controller_kit.job_spec_body())
        job_id, created = await store.create(record, {"type": "state"}, max_active=4)
        assert created and job_id == record.job_id
        with pytest.raises(IllegalTransitionError):
            await store.transition(job_id, JobState.SUCCEEDED, {"type": "state"})
        with pytest.raises(JobStateConflictError):
            await store.delete(job_id)
        assert await store.transition(job_id, JobState.RUNNING, {"type": "state"}) is JobState.PENDING
        assert await store.active_job_ids() == [job_id]
        assert await store.transition(job_id, JobState.CANCELLED, {"type": "state"}) is JobState.RUNNING
        assert await store.active_job_ids() == []
        with pytest.raises(IllegalTransitionError, match="is CANCELLED"):
            await store.transition(job_id, JobState.RUNNING, {"type": "state"})
        assert (await store.get(job_id)).state is JobState.CANCELLED
        events = await store.events(job_id, after_id="0")
        assert len(events) == 3
        await store.delete(job_id)
        with pytest.raises(JobNotFoundError):
            await store.get(job_id)
        assert await store.update(job_id, {"step": "3"}) is False  # a deleted job is not resurrected
        with pytest.raises(JobNotFoundError):
            await store.get(job_id)
    finally:
        await store.close()


@pytest.mark.integration
async def test_store_record_round_trips(redis_url: str, controller_kit: Any) -> None:
    store = JobStore(redis_url, key_prefix="t", max_events=100)
    try:
        record = _record(controller_kit.job_spec_body())
        record.metrics = {"reward_mean": 0.25}
        await store.create(record, {"type": "state"}, max_active=4)
        loaded = await store.get(record.job_id)
        assert loaded == record
    finally:
        await store.close()


def test_job_spec_needs_num_steps_and_refuses_unknown_fields(controller_kit: Any) -> None:
    body = controller_kit.job_spec_body()
    spec = JobSpec.model_validate(body)
    assert spec.train.num_steps == 3 and spec.resources.trainer.backend == "torch"
    without_train = {key: value for key, value in body.items() if key != "train"}
    with pytest.raises(ValidationError, match="num_steps must be >= 1"):
        JobSpec.model_validate(without_train)
    with pytest.raises(ValidationError, match="Extra inputs"):
        JobSpec.model_validate({**body, "resources": {"gpus": 8}})
    with pytest.raises(ValidationError, match="tp_size"):
        JobSpec.model_validate(
            {**body, "resources": {"engines": {"kind": "sglang", "gpus_per_replica": 2, "tp_size": 4}}}
        )
    with pytest.raises(ValidationError):
        spec.train.__setattr__("num_steps", 9)  # frozen


def test_settings_take_comma_separated_tokens_and_require_them_off_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_CONTROLLER_API_TOKENS", "first-token-0123456789,second-token-0123456789")
    settings = load_settings(ControllerSettings)
    assert [token.get_secret_value() for token in settings.api_tokens] == [
        "first-token-0123456789",
        "second-token-0123456789",
    ]
    assert "first-token" not in repr(settings)
    monkeypatch.setenv("MILES_CONTROLLER_API_TOKENS", "")
    monkeypatch.setenv("MILES_CONTROLLER_HOST", "0.0.0.0")
    with pytest.raises(ConfigError, match="api_tokens is required"):
        load_settings(ControllerSettings)
    monkeypatch.setenv("MILES_CONTROLLER_API_TOKENS", "short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_settings(ControllerSettings)


@pytest.mark.integration
async def test_a_resize_is_cleared_only_if_no_newer_one_arrived(redis_url: str, controller_kit: Any) -> None:
    store = JobStore(redis_url, key_prefix="t", max_events=100)
    try:
        record = _record(controller_kit.job_spec_body())
        await store.create(record, {"type": "state"}, max_active=4)
        applied = record.spec_json
        newer = JobSpec.model_validate({**controller_kit.job_spec_body(), "resources": {"engines": {"replicas": 5}}})
        await store.update(record.job_id, {"spec": newer.model_dump_json(), "resize_pending": "1"})
        assert await store.resize_applied(record.job_id, applied, {"type": "resized"}) is False
        assert (await store.get(record.job_id)).resize_pending is True
        assert await store.resize_applied(record.job_id, newer.model_dump_json(), {"type": "resized"}) is True
        assert (await store.get(record.job_id)).resize_pending is False
    finally:
        await store.close()
