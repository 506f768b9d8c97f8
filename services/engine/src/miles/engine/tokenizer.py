"""The tokenizer of the served model, read with the `tokenizers` library (no transformers at runtime).

Encoding follows SGLang's /generate: the tokenizer's default call (special tokens added as its post-processor
says; Qwen adds none), no chat template. Decoding skips special tokens unless asked otherwise; ids the
tokenizer does not know (padding rows of the embedding) decode to nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, directory: Path) -> None:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        self._tokenizer = Tokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        eos = config.get("eos_token")
        eos_text = eos.get("content") if isinstance(eos, dict) else eos
        eos_id = self._tokenizer.token_to_id(eos_text) if isinstance(eos_text, str) else None
        self.eos_token_id: int | None = eos_id
        self.size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.num_regular_tokens = self._tokenizer.get_vocab_size(with_added_tokens=False)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """The text of one token as SGLang puts it into logprob entries (special tokens kept)."""
        return str(self._tokenizer.decode([token_id], skip_special_tokens=False))
