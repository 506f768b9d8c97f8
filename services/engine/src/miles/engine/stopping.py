"""When a sequence stops, in SGLang's order: length first (so a max_new_tokens-th EOS reports length), then stop
strings and regexes on the decoded output, then end-of-sequence and stop_token_ids (both ignored with
ignore_eos). Stop strings are looked for in the whole decoded output each step, which is fine for the output
lengths of a CPU engine."""

from __future__ import annotations

import re

from miles.engine.requests import FinishReason, Sequence
from miles.engine.tokenizer import TextTokenizer


def finish_reason_after(
    seq: Sequence, token_id: int, tokenizer: TextTokenizer, eos_token_ids: frozenset[int]
) -> FinishReason | None:
    """Why `seq` stops now that `token_id` was appended to its output, or None if it goes on."""
    params = seq.sampling
    if len(seq.output_ids) >= seq.max_new_tokens:
        return FinishReason.max_length(seq.max_new_tokens)
    if params.stop or params.stop_regex:
        text = tokenizer.decode(seq.output_ids, skip_special_tokens=params.skip_special_tokens)
        for stop in params.stop:
            if stop in text:
                return FinishReason.stop_string(stop)
        for pattern in params.stop_regex:
            if re.search(pattern, text):
                return FinishReason.stop_string(pattern)
    if not params.ignore_eos and (token_id in eos_token_ids or token_id in params.stop_token_ids):
        return FinishReason.stop_token(token_id)
    return None
