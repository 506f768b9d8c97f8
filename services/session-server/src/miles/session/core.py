"""SessionCore: the session-server without its web framework (the HTTP layer parses, calls this, maps errors).

Owns: job model configs, session creation (model config resolved once: job config, else the server's default
model, then the session's overrides; idempotent with a key: a replay with the same body gets the same session and a
rotated token, since only token hashes are kept), capability-token checks, deletion and the expiry reaper. A chat
turn is `TurnRunner` (turns.py); the session view (GET) and samples are `SessionViews` (views.py). Every piece of
session state is in the store, so any replica can serve any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass

from miles.common.errors import ConfigError, MilesError
from miles.session.api_models import ChatCompletionRequest, CreateSessionRequest, JobConfigBody
from miles.session.errors import (
    IdempotencyKeyReusedError,
    InvalidJobConfigError,
    InvalidRequestError,
    InvalidSessionRequestError,
    JobNotFoundError,
    ModelUnavailableError,
    SessionBusyError,
    SessionNotFoundError,
    WrongTokenError,
)
from miles.session.metrics import SessionMetrics
from miles.session.model_assets import ModelRegistry
from miles.session.records import IdempotencyRecord, ModelConfig, SessionMeta
from miles.session.settings import SessionSettings
from miles.session.store import SessionStore
from miles.session.tito import UnknownFamilyError, get_family
from miles.session.turns import TurnRunner, TurnStart

logger = logging.getLogger(__name__)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def body_digest(request: CreateSessionRequest) -> str:
    """SHA-256 of the parsed create body as canonical JSON (key order, spacing and explicit defaults ignored)."""
    canonical = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class CreatedSession:
    session_id: str
    token: str
    ttl_s: float
    replayed: bool = False
    """An Idempotency-Key replay: the session already existed and `token` is its freshly rotated token."""


def _check_token(meta: SessionMeta, token: str, *, is_operator: bool) -> None:
    if not is_operator and not hmac.compare_digest(token_digest(token), meta.token_sha256):
        raise WrongTokenError(f"the token is not the capability token of session {meta.session_id}")


class SessionCore:
    def __init__(
        self,
        *,
        settings: SessionSettings,
        store: SessionStore,
        models: ModelRegistry,
        turns: TurnRunner,
        metrics: SessionMetrics,
    ) -> None:
        self.settings = settings
        self.store = store
        self.models = models
        self.turns = turns
        self.metrics = metrics

    # --- job configs ---------------------------------------------------------------------------------------

    async def put_job_config(self, job_id: str, body: JobConfigBody) -> ModelConfig:
        """Validate (family known, tokenizer loads, kwargs allowed by the family, routing only for a MoE model) and
        store a job's model config, its record_routing resolved (None: on for a MoE model)."""
        config = ModelConfig(**body.model_dump(exclude={"record_routing"}))
        await self._check_model(config)
        files = await self.models.files(config.model_path)
        record_routing = body.record_routing
        if record_routing is None:
            record_routing = files.routing_shape is not None
        elif record_routing and files.routing_shape is None:
            raise InvalidJobConfigError(
                f"record_routing is true but the model at model_path {config.model_path!r} is not a MoE model "
                f"(config.json model_type {files.model_type!r}; routing replay needs qwen3_moe with num_experts): "
                "omit record_routing or set it false",
                field="record_routing",
            )
        config = dataclasses.replace(config, record_routing=record_routing)
        await self.store.put_job_config(job_id, config)
        return config

    async def get_job_config(self, job_id: str) -> ModelConfig:
        config = await self.store.get_job_config(job_id)
        if config is None:
            raise JobNotFoundError(f"no model config is registered for job {job_id!r}", field="job_id")
        return config

    async def delete_job_config(self, job_id: str) -> None:
        if not await self.store.delete_job_config(job_id):
            raise JobNotFoundError(f"no model config is registered for job {job_id!r}", field="job_id")

    async def _check_model(self, config: ModelConfig) -> None:
        try:
            get_family(config.model_family)
        except UnknownFamilyError as exc:
            raise InvalidJobConfigError(exc.message, field="model_family") from None
        try:
            await self.models.get(config)
        except MilesError as exc:
            if exc.http_status >= 500:
                message = f"model_path {config.model_path!r}: {exc.message}"
                raise InvalidJobConfigError(message, field="model_path") from None
            raise

    async def _default_config(self) -> ModelConfig | None:
        if self.settings.default_model_path is None:
            return None
        return ModelConfig(
            model_path=self.settings.default_model_path,
            model_family=self.settings.default_model_family,
            engine_pool=self.settings.default_engine_pool,
            max_context_tokens=self.settings.default_max_context_tokens,
        )

    # --- sessions ------------------------------------------------------------------------------------------

    async def _resolve_model(self, request: CreateSessionRequest) -> ModelConfig:
        config = await self.store.get_job_config(request.job_id) if request.job_id else None
        config = config or await self._default_config()
        if config is None:
            if request.job_id:
                raise JobNotFoundError(
                    f"no model config is registered for job {request.job_id!r} and the server has no default model",
                    field="job_id",
                )
            raise InvalidRequestError("no job_id given and the server has no default model", field="job_id")
        return dataclasses.replace(
            config,
            model_family=request.model_family or config.model_family,
            chat_template_kwargs={**config.chat_template_kwargs, **(request.chat_template_kwargs or {})},
            sampling_defaults={**config.sampling_defaults, **(request.sampling_defaults or {})},
        )

    async def create(self, request: CreateSessionRequest, *, idempotency_key: str | None = None) -> CreatedSession:
        """A new session; with `idempotency_key`, the key's session (same body) with a rotated token (see below)."""
        claim = None
        if idempotency_key is not None:
            claim = IdempotencyRecord(token_digest(idempotency_key), "", body_digest(request))
            held = await self.store.get_idempotency(claim.key_sha256)
            replayed = await self._replay(held, claim) if held is not None else None
            if replayed is not None:
                return replayed
        config = await self._resolve_model(request)
        try:
            get_family(config.model_family)
        except UnknownFamilyError as exc:
            raise InvalidRequestError(exc.message, field="model_family") from None
        files = await self.models.files(config.model_path)  # 503 when this replica cannot load the model's files
        if config.record_routing and files.routing_shape is None:
            raise ModelUnavailableError(
                f"job {request.job_id!r} records routing, but the model at {config.model_path!r} is no longer a MoE "
                f"model (config.json model_type {files.model_type!r}); PUT the job config again",
                retry_after_s=5.0,
            )
        try:
            await self.models.get(config)  # 400 for kwargs the family forbids
        except ModelUnavailableError as exc:  # the files load, so the family does not fit them: the caller's choice
            raise InvalidRequestError(
                f"model_family {config.model_family!r} cannot serve this model: {exc.message}", field="model_family"
            ) from None
        role = request.role or ""
        if role and role not in config.roles:
            declared = f"declares the roles {config.roles}" if config.roles else "declares no roles"
            raise InvalidRequestError(
                f"role {role!r} is not a role of job {request.job_id!r}, which {declared}", field="role"
            )
        ttl_s = request.ttl_s or self.settings.default_ttl_s
        if ttl_s > self.settings.max_ttl_s:
            message = f"ttl_s must be at most the server's max_ttl_s={self.settings.max_ttl_s:g} (got {ttl_s:g})"
            raise InvalidSessionRequestError(message, field="ttl_s")
        session_id, token = uuid.uuid4().hex, secrets.token_urlsafe(32)
        meta = SessionMeta(
            session_id=session_id,
            token_sha256=token_digest(token),
            job_id=request.job_id or "",
            episode_id=request.episode_id or session_id,
            model=config,
            metadata=request.metadata or {},
            ttl_s=ttl_s,
            created_at_unix_ms=int(time.time() * 1000),
            role=role,
            tree=config.tree_sessions if request.tree is None else request.tree,
        )
        held = await self.store.create(meta, dataclasses.replace(claim, session_id=session_id) if claim else None)
        if held is not None and claim is not None:  # a concurrent request with the same key created it first
            replayed = await self._replay(held, claim)
            if replayed is not None:
                return replayed
            raise SessionBusyError("the Idempotency-Key's session ended while this request ran; retry", retry_after_s=1)
        self.metrics.sessions_created.inc()
        return CreatedSession(session_id, token, ttl_s)

    async def _replay(self, held: IdempotencyRecord, claim: IdempotencyRecord) -> CreatedSession | None:
        """The held key's session with a new token (the server keeps only hashes: the first token cannot be given
        again, so it is replaced and stops working); 422 for another body; None when the session just ended."""
        if held.body_sha256 != claim.body_sha256:
            raise IdempotencyKeyReusedError(
                f"this Idempotency-Key created session {held.session_id} with a different body; send the same body "
                "to get that session again, or use a new key for a new session",
                field="Idempotency-Key",
                details={"session_id": held.session_id},
            )
        token = secrets.token_urlsafe(32)
        meta = await self.store.rotate_token(held.session_id, token_digest(token))
        if meta is None:
            return None
        self.metrics.idempotent_replays.inc()
        return CreatedSession(meta.session_id, token, meta.ttl_s, replayed=True)

    async def authorize(self, session_id: str, token: str, *, is_operator: bool) -> SessionMeta:
        """The session if `token` is its capability token (or the caller is the operator); 404 / 403 otherwise."""
        meta = await self.store.get_meta(session_id)
        if meta is None:
            raise SessionNotFoundError(f"session {session_id} does not exist (deleted or expired)")
        _check_token(meta, token, is_operator=is_operator)
        return meta

    async def authorize_turn(self, session_id: str, token: str, *, is_operator: bool) -> TurnStart:
        """`authorize`, and the session's state read in the same round trip (a turn's phase 1 starts from it)."""
        found = await self.store.load_turn_start(
            session_id, functools.partial(_check_token, token=token, is_operator=is_operator)
        )
        if found is None:
            raise SessionNotFoundError(f"session {session_id} does not exist (deleted or expired)")
        return TurnStart(*found)

    def check_chat(self, request: ChatCompletionRequest) -> None:
        """The server's limits on a chat request (a turn, streamed or not, is run by turns.py / streaming.py)."""
        if len(request.messages) > self.settings.max_messages:
            raise InvalidRequestError(
                f"{len(request.messages)} messages exceed max_messages={self.settings.max_messages}", field="messages"
            )

    async def delete(self, session_id: str) -> None:
        if not await self.store.delete(session_id):  # waits for a rollback's phase 1 or a commit, never for the engine
            raise SessionNotFoundError(f"session {session_id} does not exist (deleted or expired)")
        self.metrics.sessions_deleted.inc()

    async def list_sessions(self, job_id: str | None, limit: int) -> list[str]:
        return await self.store.list_sessions(job_id, limit)

    async def warm_up(self) -> None:
        """Load the default model at start-up: a configured default that cannot load stops the process."""
        config = await self._default_config()
        if config is not None:
            try:
                await self.models.get(config)
            except MilesError as exc:
                raise ConfigError(f"default_model_path {config.model_path!r}: {exc.message}") from exc

    # --- expiry --------------------------------------------------------------------------------------------

    async def reap_forever(self) -> None:
        """Refresh the live-session gauge and count expiries every reap_interval_s (until cancelled)."""
        while True:
            with contextlib.suppress(MilesError):  # the store being down is reported by /readyz
                result = await self.store.reap()
                self.metrics.live_sessions.set(result.num_live)
                self.metrics.sessions_expired.inc(result.num_expired)
            await asyncio.sleep(self.settings.reap_interval_s)
