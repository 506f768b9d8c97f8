"""On-policy distillation's teacher scoring: the teacher's logprob of every token the student generated.

For each trainable sample of a finished episode, one SGLang `/generate` through the rollout router to the job's
teacher pool (header `X-Miles-Pool`): the sample's token ids as `input_ids`, `max_new_tokens` 0 (nothing is
generated), `return_logprob` with `logprob_start_len` one before the sample's response start, so
`input_token_logprobs` holds log p_teacher(token_t | tokens_<t) for every response position after its first entry:
SGLang's first entry is always null (docs/sglang-protocol.md: `[None] + computed[:-1]`), so starting at the response
start itself would lose the first response token's score. They go into `Sample.teacher_logprobs`
(0.0 where the loss mask is 0: tool and user tokens are not the student's), which the trainer turns into the
per-token advantage (miles.common.jobspec.distillation).

Limits: the teacher must share the student's tokenizer (ids are sent as they are); a teacher that cannot be
reached within the retry budget fails the episode (ABORTED, `teacher_unavailable`): a sample is never trained
without its teacher's scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from miles.common.contracts.headers import POOL_HEADER
from miles.common.http_client import traced_async_client
from miles.proto.common.v1 import common_pb2
from miles.rollout.retry import RetryableError, retry_within

_RETRY_STATUSES = frozenset({409, 429, 500, 502, 503, 504})


class TeacherUnavailableError(Exception):
    """The teacher pool gave no usable scores for a sample within the retry budget."""


class TeacherScorer:
    """Scores samples on the teacher pool `router_pool` through the router at `router_url`."""

    def __init__(
        self,
        router_url: str,
        router_pool: str,
        *,
        request_timeout_s: float,
        retry_budget_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`transport`: tests hand in a fake router; None dials `router_url`."""
        self.router_pool = router_pool
        self.retry_budget_s = retry_budget_s
        extra: dict[str, Any] = {"transport": transport} if transport is not None else {}
        self._http = traced_async_client(
            base_url=router_url.rstrip("/"), timeout=request_timeout_s, trust_env=False, **extra
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def score(self, samples: Sequence[common_pb2.Sample]) -> None:
        """Set `teacher_logprobs` on every sample (raises TeacherUnavailableError, leaving them unset)."""
        scored = [await self._logprobs(sample) for sample in samples]
        for sample, logprobs in zip(samples, scored, strict=True):
            del sample.teacher_logprobs[:]
            sample.teacher_logprobs.extend(
                lp if mask else 0.0 for lp, mask in zip(logprobs, sample.loss_mask, strict=True)
            )

    async def _logprobs(self, sample: common_pb2.Sample) -> list[float]:
        start = int(sample.response_start)
        if start < 1:
            raise TeacherUnavailableError(
                "a sample without prompt tokens cannot be scored (its first token has no context)"
            )
        body: dict[str, Any] = {
            "input_ids": list(sample.tokens),
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": start - 1,
        }
        headers = {POOL_HEADER: self.router_pool}

        async def attempt() -> list[float]:
            try:
                response = await self._http.post("/generate", json=body, headers=headers)
            except httpx.TransportError as exc:
                raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
            if response.status_code in _RETRY_STATUSES:
                raise RetryableError(f"HTTP {response.status_code}: {response.text[:200]}")
            if response.status_code != 200:
                raise TeacherUnavailableError(f"the teacher answered {response.status_code}: {response.text[:300]}")
            return _response_logprobs(response.json(), len(sample.tokens) - start)

        try:
            return await retry_within(attempt, budget_s=self.retry_budget_s)
        except RetryableError as exc:
            raise TeacherUnavailableError(f"the teacher pool {self.router_pool} is unavailable: {exc}") from exc


def _response_logprobs(answer: Any, num_response_tokens: int) -> list[float]:
    """The logprob of each response token from SGLang's `meta_info.input_token_logprobs` ([logprob, id, text?]
    entries from logprob_start_len = response start - 1 on: the first, always null, is the prompt's last token)."""
    answer = answer[0] if isinstance(answer, list) else answer
    entries = answer.get("meta_info", {}).get("input_token_logprobs") or []
    if len(entries) < num_response_tokens + 1:
        raise TeacherUnavailableError(
            f"the teacher gave {len(entries)} input logprobs for {num_response_tokens} response tokens"
        )
    values = [entry[0] for entry in entries[1 : num_response_tokens + 1]]
    if any(value is None for value in values):
        raise TeacherUnavailableError("the teacher gave no logprob for a response token")
    return [float(value) for value in values]
