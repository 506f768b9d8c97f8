"""The rollout section of a job spec: where prompts come from, which agent runs them, how episodes are scored
and grouped, and how many run at once.

The controller validates it as part of the whole `JobSpec` (422 naming the field path) and hands it to each
rollout worker as `{"rollout": {...}}` inside the JSON file named by `MILES_ROLLOUT_CONFIG_FILE`; the worker
validates it again at start-up with this same model. A job runs either its own agent (`dataset.path` and
`agent.function` are then required) or a hub environment (`environment`: the environment gives the prompts, runs
each episode and scores it). Dotted paths (`module:function`) are imported by the worker, never by the
controller.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DOTTED_PATH_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
"""`package.module:function`: the module is imported (after `python_path` is put on sys.path), then the
attribute is read."""

ROLE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
"""A role name (`solver`, `verifier`): what the session server accepts as a session's `role`."""

MAX_ROLES = 8
"""Roles of one job at most: each becomes a session per episode and a bounded `role` metric label."""

REQUEST_KWARGS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "chat_template_kwargs",
    }
)
"""OpenAI Chat Completions fields a job may set for its agents (what the session server accepts)."""


class _Section(BaseModel):
    """Base of every part of the rollout section: unknown keys refused, field docstrings kept, immutable."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class DatasetSpec(_Section):
    """Prompts: one row per prompt, read whole into memory at start-up."""

    path: str | None = Field(default=None, min_length=1)
    """JSONL or Parquet file: a local path (relative to the worker's working directory) or any fsspec URL
    whose filesystem is installed (`s3://`, `gs://`, `https://` ...). Required with an agent; none with an
    environment (its rows are the prompts; shuffle, seed, num_epochs and limit still apply)."""

    format: Literal["auto", "jsonl", "parquet"] = "auto"
    """File format; `auto` reads `.parquet` as Parquet and anything else as JSONL."""

    prompt_key: str = "prompt"
    """Row field holding the prompt: a list of OpenAI messages, or a string (becomes one user message)."""

    label_key: str = "label"
    """Row field holding the reference answer used by the built-in verifiers (absent: no label)."""

    shuffle: bool = True
    """Visit prompts in a fresh permutation each epoch (seeded by `seed` and the epoch number)."""

    seed: int = 0
    """Seed of the per-epoch permutations; the same seed and dataset give the same order on every worker."""

    num_epochs: int | None = Field(default=1, ge=1)
    """Passes over the dataset; null: forever."""

    limit: int | None = Field(default=None, ge=1)
    """Use only the first `limit` rows of the file (smoke runs and tests)."""

    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Options for the fsspec filesystem of `path` (credentials normally come from the environment)."""


class AgentSpec(_Section):
    """The user's agent: `async def agent(base_url, prompt, request_kwargs, metadata) -> dict | None`."""

    function: str = Field(pattern=DOTTED_PATH_PATTERN)
    """Dotted path `module:function` of the agent coroutine function."""

    python_path: list[str] = Field(default_factory=list)
    """Directories put in front of sys.path before importing `function` (relative: to the working directory)."""

    timeout_s: float = Field(default=600.0, gt=0)
    """Wall-clock limit of one episode's agent call; past it the agent is cancelled and the episode is ABORTED
    (reason `timeout`)."""

    config: dict[str, Any] = Field(default_factory=dict)
    """Free-form configuration handed to the agent as `metadata["agent_config"]`."""


CONNECTORS = ("reasoning_gym", "verifiers", "openenv", "harbor")
"""The built-in environment connectors (libs/miles-envserver/src/miles/envserver/connectors)."""

_CONNECTOR_PATTERN = r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$"


class EnvironmentSpec(_Section):
    """A hub environment run by an environment server in its own interpreter (docs/environments.md)."""

    connector: str = Field(pattern=_CONNECTOR_PATTERN)
    """`reasoning_gym`, `verifiers`, `openenv`, `harbor`, or the dotted module path of your own connector (a
    module with `create(args) -> miles.envserver.base.Environment`, importable by `interpreter`)."""

    args: dict[str, Any] = Field(default_factory=dict)
    """The connector's arguments (which environment, its options), passed to it unchanged as JSON."""

    python_path: list[str] = Field(default_factory=list)
    """Directories put on the server's PYTHONPATH (a custom connector's own modules; relative: to the worker's
    working directory)."""

    interpreter: str = ""
    """The Python that runs the environment server locally; "": `<envs_dir>/<connector with - for _>/bin/python`
    (built by `make env-<name>`). A custom connector names one of those or its own."""

    timeout_s: float = Field(default=600.0, gt=0)
    """Wall-clock limit of one episode (the environment's whole protocol and scoring); past it the episode is
    ABORTED (reason `timeout`)."""

    startup_timeout_s: float = Field(default=600.0, gt=0)
    """How long the server may take to load the environment before the worker gives up (and restarts it)."""

    replicas: int = Field(default=1, ge=1, le=64)
    """Environment-server pods of the job on Kubernetes (locally: one server per rollout worker)."""

    @property
    def env_name(self) -> str:
        """The name of the connector's interpreter (`.envs/<env_name>`, `make env-<env_name>`)."""
        return self.connector.replace("_", "-") if self.connector in CONNECTORS else self.connector


class AgentRewardSpec(_Section):
    """The agent's returned `reward` is the reward (0.0 and `reward_missing` in metadata when it gives none)."""

    type: Literal["agent"] = "agent"


class ExactMatchRewardSpec(_Section):
    """1.0 when the answer equals the label after trimming and collapsing whitespace, else 0.0."""

    type: Literal["exact_match"]
    case_sensitive: bool = False
    """Compare case-sensitively."""


class NumericRewardSpec(_Section):
    """1.0 when the last number of the answer (or its `\\boxed{}`) equals the label's number within tolerance."""

    type: Literal["numeric"]
    abs_tolerance: float = Field(default=1e-6, ge=0)
    """Absolute tolerance of the comparison."""
    rel_tolerance: float = Field(default=1e-6, ge=0)
    """Relative tolerance of the comparison."""


class RegexRewardSpec(_Section):
    """With a capture group: 1.0 when the first group of the first match equals the label; without: 1.0 when
    the pattern matches the answer at all."""

    type: Literal["regex"]
    pattern: str = Field(min_length=1)
    """Python regular expression searched in the answer."""


class UnitTestsRewardSpec(_Section):
    """Runs the row's tests against the answer in a fresh sandbox: 1.0 when the test command exits 0, else
    0.0 (with `partial_credit`: the fraction of `PASS` lines among `PASS`/`FAIL` lines it printed)."""

    type: Literal["unit_tests"]
    tests_key: str = "tests"
    """Row field holding the test file's text."""
    solution_file: str = "solution.py"
    """File the answer (code; a ```python fenced block is unwrapped) is written to in the sandbox work dir."""
    tests_file: str = "test_solution.py"
    """File the tests are written to."""
    command: str = "python3 test_solution.py"
    """Shell command that runs the tests; exit code 0 means they passed."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Wall-clock limit of the test command."""
    partial_credit: bool = False
    """Score the fraction of `PASS` among `PASS`/`FAIL` output lines instead of pass/fail."""
    template: str = ""
    """Sandbox template ("" = the gateway's default)."""


class FunctionRewardSpec(_Section):
    """A user reward function: `async def reward(prompt, samples, agent_result) -> float | list[float]`."""

    type: Literal["function"]
    function: str = Field(pattern=DOTTED_PATH_PATTERN)
    """Dotted path `module:function` of the reward coroutine function."""
    python_path: list[str] = Field(default_factory=list)
    """Directories put in front of sys.path before importing `function`."""


RewardSpec = Annotated[
    AgentRewardSpec
    | ExactMatchRewardSpec
    | NumericRewardSpec
    | RegexRewardSpec
    | UnitTestsRewardSpec
    | FunctionRewardSpec,
    Field(discriminator="type"),
]


class GroupFilterSpec(_Section):
    """Group-level filters run by the worker before a group is pushed (dropped groups are counted)."""

    drop_equal_rewards: bool = False
    """Drop groups whose trainable samples all have the same reward (zero GRPO advantage; DAPO); with roles: the
    same reward within each role."""

    min_valid_samples: int = Field(default=1, ge=0)
    """Drop groups with fewer trainable (COMPLETED or TRUNCATED) samples than this (0 behaves as 1)."""


class PartialRolloutSpec(_Section):
    """Episodes whose turns were generated under more than one weight version (a weight update landed while
    the episode ran)."""

    policy: Literal["keep", "keep_per_span", "regenerate"] = "keep_per_span"
    """`keep`: train on it as if the oldest version produced all of it (one span at the oldest version).
    `keep_per_span`: keep each turn's own version (the trainer corrects per span). `regenerate`: discard it and
    run the episode again, up to `max_regenerations` times; then ABORTED (reason `version_span`)."""

    max_regenerations: int = Field(default=2, ge=0)
    """Extra attempts the `regenerate` policy may make per episode."""


class ConcurrencySpec(_Section):
    """How many episodes one worker keeps in flight."""

    max_live_episodes: int | None = Field(default=None, ge=1)
    """Episodes in flight at once; null: `ceil(engine_slots * oversubscription)`."""

    engine_slots: int = Field(default=32, ge=1)
    """Requests the job's engines serve at once (engines x max running requests) for this worker's share."""

    oversubscription: float = Field(default=1.5, ge=1.0)
    """Episodes per engine slot: an episode also spends time in tools and its own code, not only generating."""

    @property
    def resolved_max_live_episodes(self) -> int:
        if self.max_live_episodes is not None:
            return self.max_live_episodes
        return max(1, math.ceil(self.engine_slots * self.oversubscription))


class RolloutSpec(_Section):
    """The rollout section of a job spec."""

    dataset: DatasetSpec = DatasetSpec()
    """Where the prompts come from (with an environment: only how its rows are ordered and repeated)."""

    agent: AgentSpec | None = None
    """The agent every episode runs (exactly one of agent and environment)."""

    environment: EnvironmentSpec | None = None
    """A hub environment that gives the prompts, runs every episode and scores it (instead of an agent)."""

    reward: RewardSpec = AgentRewardSpec()
    """How an episode is scored after it ends (the agent's own reward by default)."""

    n_samples_per_prompt: int = Field(default=8, ge=1, le=1024)
    """Episodes per prompt; they form one group (GRPO)."""

    group_filters: GroupFilterSpec = GroupFilterSpec()
    """Filters a finished group must pass to be pushed."""

    request_kwargs: dict[str, Any] = Field(default_factory=dict)
    """OpenAI Chat Completions parameters handed to the agent (`temperature`, `max_tokens`, `top_p` ...)."""

    max_seq_len: int | None = Field(default=None, ge=2)
    """Longest trained sequence (prompt + every turn, tokens); longer episodes are cut and TRUNCATED. Also
    handed to the agent as `metadata["max_seq_len"]` so it can stop early."""

    sample_mode: Literal["merge", "per_turn"] = "merge"
    """`merge`: one sample per episode; `per_turn`: one sample per model call."""

    partial_rollout: PartialRolloutSpec = PartialRolloutSpec()
    """What happens to episodes that span several weight versions."""

    concurrency: ConcurrencySpec = ConcurrencySpec()
    """Episodes in flight per worker."""

    session_ttl_s: float | None = Field(default=None, gt=0)
    """Idle expiry of the episode's session (a safety net if the worker dies); null: agent timeout + 300 s."""

    roles: list[Annotated[str, Field(pattern=ROLE_PATTERN)]] = Field(default_factory=list, max_length=MAX_ROLES)
    """Multi-agent episodes (agents only): one session per role per episode, e.g. `[solver, verifier]` (same model,
    the agent's own prompts), handed to the agent as `metadata["roles"]`; every sample carries `metadata.role`, the
    reward function may reward each role on its own, and the trainer normalises advantages per (group, role).
    Empty: one session per episode without a role. Unique names of [A-Za-z0-9_.-], at most 8."""

    tree_sessions: bool = False
    """Sessions are trees: agents that fork (best-of-n, search), retry a turn deep in their history or compact
    their context (restart from a summary) need one; each leaf path becomes a sample (docs/tito-sessions.md)."""

    @field_validator("request_kwargs")
    @classmethod
    def _known_request_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - REQUEST_KWARGS)
        if unknown:
            raise ValueError(f"unknown request kwargs {unknown}; allowed: {sorted(REQUEST_KWARGS)}")
        return value

    @field_validator("roles")
    @classmethod
    def _unique_roles(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"roles must be unique (got {value})")
        return value

    @model_validator(mode="after")
    def _agent_or_environment(self) -> Self:
        if (self.agent is None) == (self.environment is None):
            raise ValueError("give exactly one of rollout.agent (your own agent) and rollout.environment")
        if self.agent is not None and self.dataset.path is None:
            raise ValueError("rollout.dataset.path is required with rollout.agent")
        if self.environment is not None:
            if self.roles:
                raise ValueError(
                    "rollout.roles needs rollout.agent: an environment runs its own episodes in one session each"
                )
            if self.dataset.path is not None:
                raise ValueError(
                    "rollout.dataset.path must be absent with rollout.environment: its rows are the prompts"
                )
            if self.reward.type != "agent":
                raise ValueError(
                    f"rollout.reward.type must be `agent` with rollout.environment (its own scorer gives the reward), "
                    f"not {self.reward.type!r}"
                )
        return self

    @property
    def episode_timeout_s(self) -> float:
        """The agent's or the environment's per-episode limit."""
        if self.environment is not None:
            return self.environment.timeout_s
        assert self.agent is not None, "validated: an agent or an environment"
        return self.agent.timeout_s

    @model_validator(mode="after")
    def _filters_fit_group(self) -> Self:
        if self.group_filters.min_valid_samples > self.n_samples_per_prompt:
            raise ValueError(
                f"group_filters.min_valid_samples ({self.group_filters.min_valid_samples}) exceeds "
                f"n_samples_per_prompt ({self.n_samples_per_prompt}): every group would be dropped"
            )
        return self

    @property
    def resolved_session_ttl_s(self) -> float:
        return self.session_ttl_s if self.session_ttl_s is not None else self.episode_timeout_s + 300.0
