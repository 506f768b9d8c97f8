"""TitoPrompt: the next prompt of a session as TITO builds it (stored ids kept, appended ids added)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TitoPrompt:
    """The next prompt: `stored_ids[:len(stored_ids) - num_trimmed_tokens] + appended_ids`.

    Building it costs O(appended tokens); `prompt_ids` materialises the whole list on first access (a C-speed
    copy). A store that keeps ids as an appendable list can instead drop `num_trimmed_tokens` and push
    `appended_ids`.
    """

    stored_ids: Sequence[int]
    """The ids the prompt extends, as passed (not copied)."""
    appended_ids: list[int]
    num_trimmed_tokens: int
    """Trailing stored tokens replaced by the junction patch (0, or 1 for GLM's stop-as-opener tokens)."""
    appended_text: str
    """The text `appended_ids` encode (junction + appended messages + generation prompt)."""
    reasoning_open: bool
    """The generation prompt opened a `<think>` block: the completion starts inside the reasoning."""

    @functools.cached_property
    def prompt_ids(self) -> list[int]:
        """The whole prompt (computed once)."""
        num_kept = len(self.stored_ids) - self.num_trimmed_tokens
        kept = self.stored_ids if self.num_trimmed_tokens == 0 else self.stored_ids[:num_kept]
        return (kept if isinstance(kept, list) else list(kept)) + self.appended_ids
