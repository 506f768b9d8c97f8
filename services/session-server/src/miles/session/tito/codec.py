"""Token codecs: the one interface TITO uses to turn text into token ids and back.

`HFTokenizerCodec` wraps a Hugging Face `tokenizer.json` (the `tokenizers` library, no network, no
transformers import). `CharCodec` is a stand-in for model families whose tokenizer is not available offline
(GLM, Kimi, MiniMax, Qwen3.5, Nemotron here): every declared special/added token is one id and every other
character is its code point, so TITO, the comparator and the conformance suite run unchanged and check the
rendered text exactly; what it cannot check is BPE merging across a junction, which only a real tokenizer
shows. A production session passes the served model's tokenizer file (`HFTokenizerCodec.from_file`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from miles.session.tito.errors import TokenizerUnavailableError


@runtime_checkable
class TokenCodec(Protocol):
    """Text <-> token ids for one model. `encode` adds no BOS/EOS; special-token strings map to their ids."""

    name: str
    bos_token: str
    """The BOS string templates render as `bos_token` ("" when the model has none)."""
    eos_token: str

    def encode(self, text: str) -> list[int]: ...

    def encode_plain(self, text: str) -> list[int]:
        """`text` as ordinary text: special/added token strings in it are split like any other characters."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included, exactly as the model saw it."""
        ...

    def token_id(self, token: str) -> int | None:
        """The id of a single-token string (a special or added token), or None when it is not one token."""
        ...

    def special_ids(self) -> frozenset[int]:
        """Ids of the tokens flagged special: the comparator's default segment boundaries."""
        ...

    def added_token_strings(self) -> tuple[str, ...]:
        """Every added/special token string (never split by `encode`)."""
        ...


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


_FAST_ENCODE_MIN_CHARS = 16
"""Texts longer than this are encoded with `encode_batch_fast`, which skips the character offsets nobody here reads
and releases the GIL: the same ids, ~15 % sooner for a 600-token turn and ~30 % for long texts, and without the GIL
held (`encode` holds it: ~1 s for a 2 MB text, during which a server's event loop, whatever thread the encode runs
in, serves nothing; `encode_batch` holds it ~40 ms for a 550k-token text). Reading `.ids` still holds it (~20-40 ms
for 550k ids). Below this size `encode` is ~0.4 us cheaper (a special token, a junction)."""

_RELEASE_GIL_IDS = 4096
"""Id sequences longer than this are decoded with `decode_batch`, which releases the GIL (`decode` holds it: ~100 ms
for 660k ids, a session GET's TITO check of a long session)."""


class HFTokenizerCodec:
    """A Hugging Face fast tokenizer read from `tokenizer.json` (+ `tokenizer_config.json` for BOS/EOS)."""

    def __init__(self, tokenizer: Any, config: Mapping[str, Any], *, name: str) -> None:
        """`tokenizer`: a `tokenizers.Tokenizer`; `config`: the model's tokenizer_config.json contents."""
        self._tokenizer = tokenizer
        self.name = name
        # Templates render `bos_token` themselves (Llama, DeepSeek); models without one (Qwen) have null here.
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        """The model's own chat template (tokenizer_config.json), used by the `default` family."""
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(int(i) for i, tok in added.items() if tok.special)
        self._added = tuple(str(tok.content) for tok in added.values())

    @classmethod
    def from_file(cls, path: str | Path, *, name: str | None = None) -> HFTokenizerCodec:
        """Load a tokenizer.json (or a folder holding it and, optionally, tokenizer_config.json)."""
        from tokenizers import Tokenizer

        path = Path(path)
        tokenizer_json = path / "tokenizer.json" if path.is_dir() else path
        if not tokenizer_json.is_file():
            raise TokenizerUnavailableError(f"tokenizer file {tokenizer_json} does not exist")
        config_path = tokenizer_json.parent / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        return cls(Tokenizer.from_file(str(tokenizer_json)), config, name=name or tokenizer_json.parent.name)

    @classmethod
    def from_json(cls, tokenizer_json: str, config: Mapping[str, Any], *, name: str) -> HFTokenizerCodec:
        """Build from tokenizer.json contents (e.g. an edited copy of a bundled tokenizer)."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(tokenizer_json), config, name=name)

    def encode(self, text: str) -> list[int]:
        if len(text) > _FAST_ENCODE_MIN_CHARS:  # the same ids, sooner and without the GIL (see above)
            ids: list[int] = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
            return ids
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_plain(self, text: str) -> list[int]:
        """The tokenizer's own pipeline (normalizer, pre-tokenizer, model) without its added-token split: what
        `encode` gives for text that holds no added token, and plain-text ids for the token strings otherwise."""
        if not any(token in text for token in self._added):
            return self.encode(text)
        normalizer, pre_tokenizer = self._tokenizer.normalizer, self._tokenizer.pre_tokenizer
        normalized = normalizer.normalize_str(text) if normalizer is not None else text
        pieces = pre_tokenizer.pre_tokenize_str(normalized) if pre_tokenizer is not None else [(normalized, None)]
        return [int(token.id) for piece, _ in pieces for token in self._tokenizer.model.tokenize(piece)]

    def decode(self, ids: Sequence[int]) -> str:
        if len(ids) > _RELEASE_GIL_IDS:  # the same text; `decode_batch` runs without the GIL, `decode` holds it
            return str(self._tokenizer.decode_batch([list(ids)], skip_special_tokens=False)[0])
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def token_id(self, token: str) -> int | None:
        token_id = self._tokenizer.token_to_id(token)
        return None if token_id is None else int(token_id)

    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def added_token_strings(self) -> tuple[str, ...]:
        return self._added


_CHAR_TOKEN_BASE = 0x110000  # above every Unicode code point, so token ids never collide with characters


class CharCodec:
    """One id per declared token string, one id per other character (its code point)."""

    def __init__(
        self,
        *,
        name: str,
        special_tokens: Iterable[str],
        added_tokens: Iterable[str] = (),
        bos_token: str = "",
        eos_token: str = "",
    ) -> None:
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        specials = list(dict.fromkeys(special_tokens))
        tokens = list(dict.fromkeys([*specials, *added_tokens]))
        self._id_by_token = {tok: _CHAR_TOKEN_BASE + i for i, tok in enumerate(tokens)}
        self._token_by_id = {i: tok for tok, i in self._id_by_token.items()}
        self._special_ids = frozenset(self._id_by_token[tok] for tok in specials)
        # Longest first, so that `</think>` wins over a hypothetical `</`.
        alternatives = sorted(tokens, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(tok) for tok in alternatives)) if tokens else None

    def encode(self, text: str) -> list[int]:
        if self._pattern is None:
            return [ord(ch) for ch in text]
        ids: list[int] = []
        position = 0
        for match in self._pattern.finditer(text):
            ids.extend(ord(ch) for ch in text[position : match.start()])
            ids.append(self._id_by_token[match.group(0)])
            position = match.end()
        ids.extend(ord(ch) for ch in text[position:])
        return ids

    def encode_plain(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._token_by_id[i] if i >= _CHAR_TOKEN_BASE else chr(i) for i in ids)

    def token_id(self, token: str) -> int | None:
        if token in self._id_by_token:
            return self._id_by_token[token]
        return ord(token) if len(token) == 1 else None

    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def added_token_strings(self) -> tuple[str, ...]:
        return tuple(self._id_by_token)
