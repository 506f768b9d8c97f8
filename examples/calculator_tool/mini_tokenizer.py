"""The demo's small-vocabulary tokenizer: Qwen3's byte-level BPE restricted to the merges the demo's text uses.

Why: the tiny model's cost on the CPU is dominated by its LM head over Qwen3's 151,936-token vocabulary (every
sampled token, every trained token, every published version carries it). The calculator task needs a few
hundred distinct tokens, so the demo model keeps Qwen3's tokenizer *rules* (pre-tokenizer regex, byte-level
alphabet, merge order, the 26 added tokens with their special flags, the chat template) and only the merges
needed to encode the demo's rendered conversations, with ids renumbered densely from 0.

Invariant (checked by `build_mini_tokenizer`): on the corpus it was built from it produces exactly the token
strings the full Qwen3 tokenizer produces (BPE applies the lowest-ranked available merge; keeping every merge that
fires on the corpus, in the original order, replays the same merges). Any other text still encodes, into
smaller pieces down to single bytes, so nothing a sampled token decodes to is unrepresentable.

Limit: not Qwen3's ids, so a checkpoint with this tokenizer cannot load Qwen3 weights (it is for the tiny demo
model only). The TITO family stays `qwen3`: TITO works on token strings and the template, not on ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

NUM_BYTE_TOKENS = 256


def _qwen3_dir() -> Path:
    from miles.engine.tiny_model import qwen3_tokenizer_dir

    return qwen3_tokenizer_dir()


def _merge_pair(merge: Any) -> tuple[str, str]:
    if isinstance(merge, str):
        left, right = merge.split(" ", 1)
        return left, right
    return str(merge[0]), str(merge[1])


def build_mini_tokenizer(corpus: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) contents of the restricted tokenizer for `corpus`."""
    from tokenizers import Tokenizer

    source = _qwen3_dir()
    full_json = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    full = Tokenizer.from_str(json.dumps(full_json))
    texts = list(corpus)
    used: set[str] = set()
    for encoding in full.encode_batch(texts, add_special_tokens=False):
        used.update(encoding.tokens)
    vocab: dict[str, int] = full_json["model"]["vocab"]
    merges = [_merge_pair(m) for m in full_json["model"]["merges"]]
    produced_by = {left + right: (left, right) for left, right in reversed(merges)}  # first merge wins
    needed: set[str] = set()
    stack = [token for token in used if token in vocab]
    while stack:
        token = stack.pop()
        if token in needed:
            continue
        needed.add(token)
        if token in produced_by:
            stack.extend(produced_by[token])
    byte_tokens = sorted((token for token in vocab if len(token) == 1), key=vocab.__getitem__)[:NUM_BYTE_TOKENS]
    kept_merges = [
        (a, b)
        for a, b in merges
        if a + b in needed and a in needed | set(byte_tokens) and b in needed | set(byte_tokens)
    ]
    mini_vocab: dict[str, int] = {}
    for token in [*byte_tokens, *(a + b for a, b in kept_merges)]:
        mini_vocab.setdefault(token, len(mini_vocab))
    added = []
    id_map: dict[int, int] = {}
    for entry in full_json["added_tokens"]:
        new_id = len(mini_vocab) + len(added)
        id_map[entry["id"]] = new_id
        added.append({**entry, "id": new_id})
    mini_json = dict(full_json)
    mini_json["model"] = {**full_json["model"], "vocab": mini_vocab, "merges": [[a, b] for a, b in kept_merges]}
    mini_json["added_tokens"] = added
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {
        str(id_map[int(old)]): value for old, value in config.get("added_tokens_decoder", {}).items()
    }
    _check_same_tokens(full, Tokenizer.from_str(json.dumps(mini_json)), texts)
    return mini_json, config


def _check_same_tokens(full: Any, mini: Any, texts: list[str]) -> None:
    for text in texts:
        expected = full.encode(text, add_special_tokens=False).tokens
        got = mini.encode(text, add_special_tokens=False).tokens
        if expected != got:
            raise AssertionError(f"mini tokenizer differs from Qwen3 on {text[:80]!r}: {got[:20]} vs {expected[:20]}")


def vocab_size_of(tokenizer_json: dict[str, Any]) -> int:
    """Model vocabulary size for this tokenizer: every id, rounded up to a multiple of 64."""
    num_ids = len(tokenizer_json["model"]["vocab"]) + len(tokenizer_json["added_tokens"])
    return (num_ids + 63) // 64 * 64


def write_tokenizer(out_dir: Path, tokenizer_json: dict[str, Any], config: dict[str, Any]) -> None:
    """tokenizer.json + tokenizer_config.json (the chat template stays Qwen3's); vocab.json/merges.txt removed."""
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    for stale in ("vocab.json", "merges.txt"):
        (out_dir / stale).unlink(missing_ok=True)
