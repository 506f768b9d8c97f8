"""TITO (token in, token out) for multi-turn sessions: the next prompt's ids extend the stored ids bit for bit.

Importable without FastAPI or transformers. What a session service uses:

- `get_family(name)` -> `Family`: a model family's template, pinned kwargs, append roles, junction patch,
  `max_trim_tokens`, stop tokens, comparator settings and completion parser (`family_names()` lists them).
- `TitoTokenizer(family, codec, chat_template=..., chat_template_kwargs=...)`:
  `first_prompt(messages, tools=...)` for a session's first turn; `extend(stored_ids, previous_messages,
  appended_messages, tools=..., chat_template_kwargs=...)` -> `TitoPrompt` for every later turn;
  `parse_completion(ids, reasoning_open=..., tools=...)` -> `ParsedCompletion` (an OpenAI assistant message);
  `max_trim_tokens` / `trailing_token_ids` for the sample builder; `comparator()` and `encode_messages(...)`
  for the end-of-session check.
- `split_appended(stored_messages, request_messages)`: the appended messages, or `NonAppendHistoryError`.
- `HFTokenizerCodec.from_file(path)`: the served model's tokenizer.json (`CharCodec` for text-level checks).
- `TokenSeqComparator` / `ComparisonResult.to_metadata()` and `register_tito_metrics(Metrics("session"))`.

Errors are subclasses of `miles.common.errors` classes (see `errors.py`).
"""

from miles.session.tito.codec import CharCodec, HFTokenizerCodec, TokenCodec
from miles.session.tito.comparator import ComparisonResult, Mismatch, MismatchKind, TokenSeqComparator
from miles.session.tito.errors import (
    ChatTemplateKwargConflictError,
    InvalidMessageError,
    InvalidToolCallArgumentsError,
    NonAppendHistoryError,
    TemplateNotPrefixError,
    TemplateRenderError,
    TokenizerUnavailableError,
    UnknownFamilyError,
    UnsupportedRoleError,
)
from miles.session.tito.families import ROLE_SETS, Family, Junction, family_names, get_family
from miles.session.tito.messages import split_appended
from miles.session.tito.metrics import TitoMetrics, register_tito_metrics
from miles.session.tito.parsers import ParsedCompletion, ParsedToolCall, ToolCallFormat
from miles.session.tito.prompt import TitoPrompt
from miles.session.tito.tokenizer import TitoTokenizer

__all__ = [
    "ROLE_SETS",
    "CharCodec",
    "ChatTemplateKwargConflictError",
    "ComparisonResult",
    "Family",
    "HFTokenizerCodec",
    "InvalidMessageError",
    "InvalidToolCallArgumentsError",
    "Junction",
    "Mismatch",
    "MismatchKind",
    "NonAppendHistoryError",
    "ParsedCompletion",
    "ParsedToolCall",
    "TemplateNotPrefixError",
    "TemplateRenderError",
    "TitoMetrics",
    "TitoPrompt",
    "TitoTokenizer",
    "TokenCodec",
    "TokenSeqComparator",
    "TokenizerUnavailableError",
    "ToolCallFormat",
    "UnknownFamilyError",
    "UnsupportedRoleError",
    "family_names",
    "get_family",
    "register_tito_metrics",
    "split_appended",
]
