"""reasoning-gym: one of its procedural datasets as the prompts, the dataset's own scorer as the reward.

Args (the job spec's `rollout.environment.args`):

    dataset        a reasoning-gym dataset name (`basic_arithmetic`, `chain_sum`, `leg_counting`, ...)
    size           number of rows generated (default 256)
    seed           the generator's seed (default 0): same seed, same rows
    config         the dataset's own options (fields of its config dataclass, e.g. {"max_terms": 2})
    system_prompt  a name of `reasoning_gym.utils.SYSTEM_PROMPTS` (default "default") or the text itself;
                   "" sends no system message

An episode is single-turn (reasoning-gym defines no protocol beyond question and answer): one chat completion
through the session endpoint with the request's sampling parameters, the answer extracted the package's way
(`reasoning_gym.utils.extract_answer`: the last `<answer>...</answer>`), scored by the dataset's own
`score_answer(answer, entry)` (1.0 right, partial credit where the dataset gives it, 0.0 without an answer).
Entries are generated once in `setup` and kept in memory: scorers need the whole entry (its metadata), which
need not be JSON, so a row carries only the entry's index.

The `composite` dataset mixes several by weight: `config: {datasets: [{name, weight, config}, ...]}` (the package's
YAML layout). Limits: curricula are not used (the difficulty is fixed by `config`); each row's prompt is the
entry's question as one user turn (no few-shot examples, no multi-turn protocol: reasoning-gym has none).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from miles.envserver import model_client
from miles.envserver.base import ConnectorArgsError, Environment
from miles.envserver.protocol import EpisodeRequest, EpisodeResult, Row

DEFAULT_SIZE = 256
MAX_SIZE = 1_000_000
DEFAULT_SYSTEM_PROMPT = "default"
_ARGS = ("dataset", "size", "seed", "config", "system_prompt")
_NUM_NAMES_SHOWN = 12
_MAX_ANSWER_CHARS = 200
"""reward_info keeps the extracted answer up to this many characters (for reading samples, not for scoring)."""


def _int_arg(args: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConnectorArgsError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _dataset_classes(name: Any) -> tuple[type[Any], type[Any]]:
    """(dataset class, config dataclass) of a registered dataset; the error lists some valid names."""
    from reasoning_gym.factory import DATASETS

    if not isinstance(name, str) or name not in DATASETS:
        names = sorted(DATASETS)
        shown = ", ".join(names[:_NUM_NAMES_SHOWN])
        raise ConnectorArgsError(
            f"dataset must be a reasoning-gym dataset name, got {name!r}; {len(names)} exist: {shown}, ..."
        )
    classes: tuple[type[Any], type[Any]] = DATASETS[name]
    return classes


def _system_prompt(value: Any) -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if not isinstance(value, str):
        raise ConnectorArgsError(f"system_prompt must be a string, got {value!r}")
    return str(SYSTEM_PROMPTS.get(value, value))


def _composite_specs(value: Any) -> list[Any]:
    """The composite's `datasets` as its DatasetSpec objects (from JSON objects {name, weight, config})."""
    from reasoning_gym.composite import DatasetSpec

    if not isinstance(value, list) or not value or not all(isinstance(spec, dict) for spec in value):
        raise ConnectorArgsError("config.datasets must be a non-empty list of {name, weight, config} objects")
    specs = []
    for i, spec in enumerate(value):
        try:
            specs.append(DatasetSpec(**{"config": {}, **spec}))
        except TypeError as exc:
            raise ConnectorArgsError(f"config.datasets[{i}]: {exc}") from exc
        try:
            _dataset_classes(spec["name"])
        except ConnectorArgsError as exc:
            raise ConnectorArgsError(f"config.datasets[{i}].name: {exc}") from None
    return specs


def _make_dataset(name: str, config: dict[str, Any], size: int, seed: int) -> Any:
    """The dataset object (entries are generated lazily by index); config errors name the field."""
    import reasoning_gym

    _, config_cls = _dataset_classes(name)
    fields = {f.name for f in dataclasses.fields(config_cls)} - {"size", "seed"}
    for key in config:
        if key in ("size", "seed"):
            raise ConnectorArgsError(f"config.{key}: give it as the connector's own `{key}` argument")
        if key not in fields:
            raise ConnectorArgsError(f"config.{key}: not an option of {name}; its options: {sorted(fields)}")
    if name == "composite":
        config = {**config, "datasets": _composite_specs(config.get("datasets"))}
    try:
        return reasoning_gym.create_dataset(name, **config, size=size, seed=seed)
    except (AssertionError, TypeError, ValueError) as exc:  # the config dataclass's own validate()
        raise ConnectorArgsError(f"config: {name} refused {config}: {exc or type(exc).__name__}") from exc


def _json_label(answer: Any) -> Any:
    try:
        json.dumps(answer)
    except (TypeError, ValueError):
        return str(answer)
    return answer


class ReasoningGymEnvironment(Environment):
    connector = "reasoning_gym"

    def __init__(self, dataset_name: str, dataset: Any, system_prompt: str) -> None:
        self.dataset_name = dataset_name
        self.dataset = dataset
        self.system_prompt = system_prompt
        self.entries: list[dict[str, Any]] = []
        self._rows: list[Row] = []

    @property
    def name(self) -> str:
        return self.dataset_name

    async def setup(self) -> None:
        # Generating entries is plain Python and can take seconds (puzzles): off the event loop.
        self.entries = await asyncio.to_thread(lambda: [self.dataset[i] for i in range(len(self.dataset))])
        self._rows = [self._row(index, entry) for index, entry in enumerate(self.entries)]

    def _messages(self, question: str) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": question}]

    def _row(self, index: int, entry: dict[str, Any]) -> Row:
        info = {"index": index, "dataset": self.dataset_name}
        return Row(prompt=self._messages(str(entry["question"])), label=_json_label(entry["answer"]), info=info)

    def rows(self) -> list[Row]:
        return self._rows

    def _entry_of(self, request: EpisodeRequest) -> tuple[int, dict[str, Any]]:
        index = request.row.info.get("index", request.row_index)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.entries):
            raise ValueError(f"row.info.index must be an entry index in [0, {len(self.entries)}), got {index!r}")
        return index, self.entries[index]

    async def run_episode(self, request: EpisodeRequest) -> EpisodeResult:
        from reasoning_gym.utils import extract_answer

        index, entry = self._entry_of(request)
        message = await model_client.chat(request, self._messages(str(entry["question"])))
        completion = message.get("content") or ""
        answer = extract_answer(completion)
        # Scorers are package code of unknown cost (some parse with sympy): off the event loop.
        score = float(await asyncio.to_thread(self.dataset.score_answer, answer, entry))
        reward_info = {
            "score": score,
            "answer_found": answer is not None,
            "answer": None if answer is None else answer[:_MAX_ANSWER_CHARS],
        }
        metadata = {"dataset": self.dataset_name, "index": index, "finish_reason": message.get("finish_reason")}
        return EpisodeResult(reward=score, reward_info=reward_info, metadata=metadata)


def create(args: dict[str, Any]) -> ReasoningGymEnvironment:
    """Validates `args` (ConnectorArgsError naming the field) and builds the dataset; entries come in `setup`."""
    unknown = sorted(set(args) - set(_ARGS))
    if unknown:
        raise ConnectorArgsError(f"unknown args {unknown}; reasoning_gym takes {list(_ARGS)}")
    if "dataset" not in args:
        raise ConnectorArgsError("dataset is required (a reasoning-gym dataset name, e.g. basic_arithmetic)")
    name = args["dataset"]
    _dataset_classes(name)
    size = _int_arg(args, "size", DEFAULT_SIZE, 1, MAX_SIZE)
    seed = _int_arg(args, "seed", 0, 0, 2**32 - 1)
    config = args.get("config", {})
    if not isinstance(config, dict):
        raise ConnectorArgsError(f"config must be an object of {name}'s options, got {config!r}")
    system_prompt = _system_prompt(args.get("system_prompt", DEFAULT_SYSTEM_PROMPT))
    return ReasoningGymEnvironment(name, _make_dataset(name, config, size, seed), system_prompt)
