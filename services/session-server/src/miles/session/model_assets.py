"""Model assets of a session: the TITO tokenizer built from a model directory, cached per process.

A model directory has the Hugging Face layout: `tokenizer.json`, `tokenizer_config.json` (bos/eos tokens and,
usually, `chat_template`), optionally `chat_template.jinja` and `config.json` (max_position_embeddings gives the
context length when the job config does not; a qwen3_moe `model_type` gives the routing shape of R3). Families
with a fixed template use ours; the others use the model's own template. Loading a tokenizer takes ~1 s, so it
runs in a worker thread, once per path (concurrent requests for the same path share one load), and the results are
kept in small LRU caches. Nothing here is per-session state: every replica rebuilds the same objects from the same
files.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from miles.common.contracts.routing import RoutingShape, routing_shape_from_hf_config
from miles.common.errors import MilesError
from miles.session.errors import ModelUnavailableError
from miles.session.records import ModelConfig, dumps
from miles.session.tito import HFTokenizerCodec, TitoTokenizer, TokenizerUnavailableError, get_family

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class ModelFiles:
    """What one model directory gives, independent of family and kwargs."""

    codec: HFTokenizerCodec
    chat_template: str | None
    max_position_embeddings: int | None
    model_type: str | None = None
    """config.json's model_type (None without a config.json)."""
    routing_shape: RoutingShape | None = None
    """The MoE routing shape (`routing_shape_from_hf_config`); None for a dense model."""


@dataclass(frozen=True)
class SessionModel:
    """Everything a turn needs about its model."""

    tito: TitoTokenizer
    max_context_tokens: int | None
    eos_token_id: int | None
    name: str
    routing: RoutingShape | None = None
    """Set when the session records routing (R3): the shape of the rows turns ask for and samples carry."""


def read_chat_template(model_dir: Path) -> str | None:
    """tokenizer_config.json's chat_template (a string, or the `default` of a named list), else chat_template.jinja."""
    config_path = model_dir / "tokenizer_config.json"
    if config_path.is_file():
        template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):
            for entry in template:
                if (
                    isinstance(entry, dict)
                    and entry.get("name") == "default"
                    and isinstance(entry.get("template"), str)
                ):
                    return str(entry["template"])
    jinja_path = model_dir / "chat_template.jinja"
    return jinja_path.read_text(encoding="utf-8") if jinja_path.is_file() else None


def load_model_files(model_path: str) -> ModelFiles:
    """Read a model directory (blocking; ~1 s for a large vocabulary)."""
    model_dir = Path(model_path)
    if not (model_dir / "tokenizer.json").is_file():
        raise ModelUnavailableError(f"model directory {model_path!r} has no tokenizer.json", retry_after_s=5.0)
    codec = HFTokenizerCodec.from_file(model_dir, name=model_dir.name)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    value = config.get("max_position_embeddings")
    max_positions = int(value) if isinstance(value, int) else None
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    try:
        shape = routing_shape_from_hf_config(config)
    except (KeyError, TypeError, ValueError) as exc:
        message = f"{config_path}: a {model_type} config without a valid MoE layout ({type(exc).__name__}: {exc})"
        raise ModelUnavailableError(message, retry_after_s=5.0) from None
    return ModelFiles(codec, read_chat_template(model_dir), max_positions, model_type, shape)


class _AsyncLru(Generic[K, V]):
    """An LRU cache whose misses are computed once even when requested concurrently."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._values: OrderedDict[K, V] = OrderedDict()
        self._pending: dict[K, asyncio.Future[V]] = {}

    async def get(self, key: K, compute: Callable[[], Awaitable[V]]) -> V:
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            value = await compute()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waits
            raise
        finally:
            self._pending.pop(key, None)
        future.set_result(value)
        self._values[key] = value
        if len(self._values) > self._capacity:
            self._values.popitem(last=False)
        return value


class ModelRegistry:
    """Builds and caches `SessionModel`s; `get` raises 400-class errors for bad kwargs, 503 for missing files."""

    def __init__(self, cache_size: int) -> None:
        self._files: _AsyncLru[str, ModelFiles] = _AsyncLru(cache_size)
        self._models: _AsyncLru[tuple[str, str, str, int | None, bool, bool], SessionModel] = _AsyncLru(cache_size * 4)

    async def files(self, model_path: str) -> ModelFiles:
        async def load() -> ModelFiles:
            try:
                return await asyncio.to_thread(load_model_files, model_path)
            except MilesError:
                raise
            except Exception as exc:  # a broken file: tokenizers raises plain Exception
                raise ModelUnavailableError(
                    f"cannot load the tokenizer of {model_path!r}: {type(exc).__name__}: {exc}", retry_after_s=5.0
                ) from exc

        return await self._files.get(model_path, load)

    async def get(self, config: ModelConfig) -> SessionModel:
        """The model of a session whose resolved config is `config` (kwargs included)."""
        key = (
            config.model_path,
            config.model_family,
            dumps(config.chat_template_kwargs),
            config.max_context_tokens,
            config.split_special_tokens,
            config.record_routing,
        )

        async def build() -> SessionModel:
            family = get_family(config.model_family)
            files = await self.files(config.model_path)
            try:
                tito = TitoTokenizer(
                    family,
                    files.codec,
                    chat_template=files.chat_template,
                    chat_template_kwargs=config.chat_template_kwargs,
                    split_special_tokens=config.split_special_tokens,
                )
            except TokenizerUnavailableError as exc:  # a start-up class of error, but here it is per model
                raise ModelUnavailableError(exc.message, retry_after_s=5.0) from exc
            eos = files.codec.token_id(files.codec.eos_token) if files.codec.eos_token else None
            if config.record_routing and files.routing_shape is None:  # the directory changed since the job's PUT
                message = f"{config.model_path!r} is no MoE model (model_type {files.model_type!r}): no routing"
                raise ModelUnavailableError(message, retry_after_s=5.0)
            return SessionModel(
                tito=tito,
                max_context_tokens=config.max_context_tokens or files.max_position_embeddings,
                eos_token_id=eos,
                name=Path(config.model_path).name or config.model_path,
                routing=files.routing_shape if config.record_routing else None,
            )

        return await self._models.get(key, build)
