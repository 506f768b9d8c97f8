"""Building SGLang's /generate response objects from the scheduler's updates (HTTP side, one per sequence).

Shape (SGLang HEAD, non-incremental streaming): `{"text", "output_ids", "meta_info": {...}}` where text,
output_ids and logprob lists are cumulative in every stream chunk, `finish_reason` is null until the last chunk
and `e2e_latency` appears on the last one. `output_ids` include a stop token; `text` does not (unless
`no_stop_trim`), and stops before a matched stop string. Logprob entries are 3-element lists
`[logprob, token_id, text or null]`. A sequence aborted while still queued reports the reduced meta_info SGLang
sends then (no prompt_tokens / cached_tokens). `routed_experts` (MoE, when asked for and enabled) is base64 of
little-endian int32 and appears on the last chunk only, as SGLang sends it.
"""

from __future__ import annotations

import base64
import re
import time
from typing import Any

from miles.engine.requests import FinishReason, LogprobOptions, SamplingParams, SeqUpdate, TokenLogprobs
from miles.engine.tokenizer import TextTokenizer

LogprobEntry = list[Any]


class ResponseBuilder:
    def __init__(
        self,
        *,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        options: LogprobOptions,
        tokenizer: TextTokenizer,
        arrival_time_s: float,
        return_prompt_token_ids: bool = False,
    ) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.options = options
        self._tokenizer = tokenizer
        self._arrival_time_s = arrival_time_s
        self._return_prompt_token_ids = return_prompt_token_ids
        self.output_ids: list[int] = []
        self.output_logprobs: list[TokenLogprobs] = []
        self.input_logprobs: tuple[TokenLogprobs | None, ...] = ()
        self.cached_tokens: int | None = None
        self.finish: FinishReason | None = None
        self.weight_version = "default"
        self.version_spans: list[list[Any]] = []
        """[start, end, weight_version] over output_ids: which weights sampled each token (a request that an
        in-place or retract pause carried across a weight update has several)."""
        self.routed_experts_b64: str | None = None
        self._e2e_latency_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def apply(self, update: SeqUpdate) -> None:
        if update.new_token_ids:
            self._add_span(len(update.new_token_ids), update.weight_version)
        self.output_ids.extend(update.new_token_ids)
        self.output_logprobs.extend(update.new_logprobs)
        if update.cached_tokens is not None:
            self.cached_tokens = update.cached_tokens
        if update.input_logprobs is not None:
            self.input_logprobs = update.input_logprobs
        self.weight_version = update.weight_version
        if update.routed_experts is not None:
            self.routed_experts_b64 = base64.b64encode(update.routed_experts).decode("ascii")
        if update.finish is not None:
            self.finish = update.finish
            self._e2e_latency_s = time.monotonic() - self._arrival_time_s

    def render(self) -> dict[str, Any] | None:
        """The response (or stream chunk) for the current state; None for a chunk that must be held back
        because its text may end inside a stop string or an incomplete UTF-8 character."""
        text = self._text()
        if text is None:
            return None
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": None if self.finish is None else self.finish.to_json(),
            "weight_version": self.weight_version,
            "miles_weight_version_spans": [list(span) for span in self.version_spans],
        }
        queued_abort = self.finish is not None and self.finish.in_waiting_queue
        if not queued_abort:
            meta["prompt_tokens"] = len(self.prompt_ids)
            meta["cached_tokens"] = self.cached_tokens or 0
        meta["completion_tokens"] = len(self.output_ids)
        if self._e2e_latency_s is not None:
            meta["e2e_latency"] = self._e2e_latency_s
        if self.options.return_logprob:
            self._add_logprobs(meta)
        if self.routed_experts_b64 is not None:
            meta["routed_experts"] = self.routed_experts_b64
        response: dict[str, Any] = {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}
        if self._return_prompt_token_ids:
            response["prompt_token_ids"] = list(self.prompt_ids)
        return response

    def _add_span(self, num_tokens: int, weight_version: str) -> None:
        start = len(self.output_ids)
        if self.version_spans and self.version_spans[-1][2] == weight_version:
            self.version_spans[-1][1] = start + num_tokens
        else:
            self.version_spans.append([start, start + num_tokens, weight_version])

    def _text(self) -> str | None:
        params, finish = self.sampling, self.finish
        ids = self.output_ids
        if finish is not None and finish.kind == "stop" and isinstance(finish.matched, int) and not params.no_stop_trim:
            ids = ids[:-1]
        text = self._tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if finish is not None and finish.kind == "stop" and isinstance(finish.matched, str):
            return _trim_stop(text, finish.matched, params)
        if finish is None:
            if text.endswith("\ufffd"):
                return None
            if any(text.endswith(stop[:k]) for stop in params.stop for k in range(1, len(stop))):
                return None
        return text

    def _add_logprobs(self, meta: dict[str, Any]) -> None:
        with_text = self.options.return_text_in_logprobs
        inputs = [entry for entry in self.input_logprobs if entry is not None]
        meta["input_token_logprobs"] = [self._entry(e.logprob, e.token_id, with_text) for e in inputs]
        meta["output_token_logprobs"] = [self._entry(e.logprob, e.token_id, with_text) for e in self.output_logprobs]
        meta["output_token_logprobs_length"] = len(self.output_logprobs)
        if self.options.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [self._pairs(e.top, with_text) for e in inputs]
            meta["output_top_logprobs"] = [self._pairs(e.top, with_text) for e in self.output_logprobs]
        if self.options.token_ids_logprob is not None:
            meta["input_token_ids_logprobs"] = [self._pairs(e.by_id, with_text) for e in inputs]
            meta["output_token_ids_logprobs"] = [self._pairs(e.by_id, with_text) for e in self.output_logprobs]

    def _entry(self, logprob: float | None, token_id: int, with_text: bool) -> LogprobEntry:
        return [logprob, token_id, self._tokenizer.token_text(token_id) if with_text else None]

    def _pairs(self, pairs: tuple[tuple[float, int], ...] | None, with_text: bool) -> list[LogprobEntry] | None:
        if pairs is None:
            return None
        return [self._entry(logprob, token_id, with_text) for logprob, token_id in pairs]


def _trim_stop(text: str, matched: str, params: SamplingParams) -> str:
    if matched in params.stop:
        index = text.find(matched)
        if index < 0:
            return text
        return text[: index + len(matched)] if params.no_stop_trim else text[:index]
    found = re.search(matched, text)
    if found is None:
        return text
    return text[: found.end()] if params.no_stop_trim else text[: found.start()]
