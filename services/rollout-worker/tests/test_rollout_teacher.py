"""Teacher scoring (on-policy distillation): the request it sends the router, what it reads back, and a teacher
that cannot answer. An httpx MockTransport plays the router (it records the requests it got)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from miles.proto.common.v1 import common_pb2
from miles.rollout.teacher import TeacherScorer, TeacherUnavailableError


class FakeRouter:
    """Answers /generate as SGLang does (entries for input_ids[logprob_start_len:], the first one null) with
    logprob -p/8 at position p, or `status` when it is not 200."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.status = 200

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.received.append({"pool": request.headers.get("x-miles-pool"), "path": request.url.path, **body})
        if self.status != 200:
            return httpx.Response(self.status, text="no")
        start, ids = body["logprob_start_len"], body["input_ids"]
        entries = [[None if p == start else -(p / 8), ids[p], None] for p in range(start, len(ids))]
        return httpx.Response(200, json={"text": "", "meta_info": {"input_token_logprobs": entries}})

    def scorer(self, retry_budget_s: float = 1.0) -> TeacherScorer:
        transport = httpx.MockTransport(self.handle)
        return TeacherScorer(
            "http://router", "job--teacher", request_timeout_s=5, retry_budget_s=retry_budget_s, transport=transport
        )


async def test_every_response_token_gets_the_teachers_logprob_and_masked_ones_zero() -> None:
    router = FakeRouter()
    scorer = router.scorer()
    sample = common_pb2.Sample(tokens=[5, 6, 7, 8, 9], response_start=2, loss_mask=[1, 0, 1])
    try:
        await scorer.score([sample])
    finally:
        await scorer.close()
    assert list(sample.teacher_logprobs) == [-0.25, 0.0, -0.5]  # positions 2 and 4; 3 is masked
    sent = router.received[0]
    assert (sent["path"], sent["pool"], sent["input_ids"]) == ("/generate", "job--teacher", [5, 6, 7, 8, 9])
    assert (sent["logprob_start_len"], sent["return_logprob"], sent["sampling_params"]["max_new_tokens"]) == (
        1,
        True,
        0,
    )


@pytest.mark.parametrize(("status", "retried"), [(503, True), (400, False)])
async def test_a_teacher_that_cannot_answer_leaves_the_sample_unscored(status: int, retried: bool) -> None:
    router = FakeRouter()
    router.status = status
    scorer = router.scorer(retry_budget_s=0.5)
    sample = common_pb2.Sample(tokens=[5, 6, 7], response_start=1, loss_mask=[1, 1])
    try:
        with pytest.raises(TeacherUnavailableError, match=str(status)):
            await scorer.score([sample])
    finally:
        await scorer.close()
    assert not sample.teacher_logprobs
    assert (len(router.received) > 1) is retried, len(router.received)
