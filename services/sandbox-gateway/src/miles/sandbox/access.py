"""Who may use which sandboxes: the bearer tokens of the gateway's control API (HTTP /v1/sandboxes and every
SandboxService RPC). Transport-free: both transports pass the raw `authorization` value and the ids in question.

- The **operator token** (`settings.operator_token`) opens every sandbox of every job.
- A **job capability**, `job_capability(operator_token, SANDBOX_CAPABILITY, job_id)` (minted by the controller
  for each job, miles.common.auth), opens only that job's sandboxes: Create must name that job, List must filter
  on it, and a call by sandbox id for another job's sandbox answers exactly as for an id that does not exist
  (404 / NOT_FOUND; Destroy: `destroyed: false`), so a job cannot even learn other jobs' sandbox ids.
- No token: UnauthenticatedError (401 / UNAUTHENTICATED). A token that is neither: PermissionDeniedError (403 /
  PERMISSION_DENIED). Every comparison is constant-time (`tokens_match`).
- An empty operator token (allowed on a loopback host only, see settings) leaves everything open.

A capability is an HMAC of its job id, so a token alone does not say which job it belongs to. On calls by sandbox
id a token that does not open the sandbox is therefore told apart from a wrong one by trying the jobs the gateway
knows: those with live sandboxes, and the last MAX_RECOGNISED_JOBS whose capability opened a Create or a List. A
job's token not known that way (e.g. after a gateway restart, before the job's next Create or List) gets 403 on
calls by sandbox id; it never gets more access than its own job's.

Limits: tokens are static (rotating the operator token changes every job's capability: restart the gateway and
the controller together); plain bearer, so confidentiality in transit is the network's (see miles.common.auth).
"""

from __future__ import annotations

from collections import OrderedDict

from miles.common.auth import SANDBOX_CAPABILITY, bearer_of, job_capability, tokens_match
from miles.common.errors import PermissionDeniedError, UnauthenticatedError
from miles.sandbox.core import SandboxGateway
from miles.sandbox.errors import SandboxNotFoundError

MAX_RECOGNISED_JOBS = 4096
WHAT = "the sandbox gateway's API"


class SandboxAccess:
    """Checks each call's bearer token against the ids it names; raises the error the caller gets."""

    def __init__(self, operator_token: str, gateway: SandboxGateway) -> None:
        self._operator_token = operator_token
        self._gateway = gateway
        self._recognised: OrderedDict[str, str] = OrderedDict()  # job_id -> its capability, oldest first

    @property
    def enabled(self) -> bool:
        return bool(self._operator_token)

    def check_create(self, authorization: str | None, job_id: str) -> None:
        """Create for job_id: the operator, or job_id's own capability."""
        token = self._token(authorization)
        if token is not None and not self._opens_job(token, job_id):
            raise PermissionDeniedError(f"this token does not open job {job_id!r} at {WHAT}", field="job_id")

    def check_list(self, authorization: str | None, job_id: str) -> None:
        """List: the operator (any filter), or a job's capability filtering on that job."""
        token = self._token(authorization)
        if token is None:
            return
        if not job_id:
            raise PermissionDeniedError("a job's token lists only its own job's sandboxes: set job_id", field="job_id")
        if not self._opens_job(token, job_id):
            raise PermissionDeniedError(f"this token does not open job {job_id!r} at {WHAT}", field="job_id")

    def sees_sandbox(self, authorization: str | None, sandbox_id: str) -> bool:
        """Whether the caller may act on sandbox_id, False also for an id that is not live (the two must look the
        same); raises UnauthenticatedError / PermissionDeniedError for a missing or unknown token."""
        token = self._token(authorization)
        if token is None:
            return True
        job_id = self._gateway.job_of(sandbox_id)
        if job_id is not None and self._opens_job(token, job_id):
            return True
        if self._is_a_known_jobs_capability(token):
            return False
        raise PermissionDeniedError(f"this token is not accepted by {WHAT}")

    def check_sandbox(self, authorization: str | None, sandbox_id: str) -> None:
        """`sees_sandbox`, with SandboxNotFoundError (404 / NOT_FOUND) for a sandbox the caller may not see."""
        if not self.sees_sandbox(authorization, sandbox_id):
            raise SandboxNotFoundError.of(sandbox_id)

    # -- internals ---------------------------------------------------------------------------------------------

    def _token(self, authorization: str | None) -> str | None:
        """None: the caller is the operator (or the API is open); else the bearer token to check against jobs."""
        if not self.enabled:
            return None
        token = bearer_of(authorization)
        if not token:
            raise UnauthenticatedError(f"{WHAT} needs `Authorization: Bearer <token>`")
        return None if tokens_match(token, self._operator_token) else token

    def _capability(self, job_id: str) -> str:
        return self._recognised.get(job_id) or job_capability(self._operator_token, SANDBOX_CAPABILITY, job_id)

    def _opens_job(self, token: str, job_id: str) -> bool:
        capability = self._capability(job_id)
        if not tokens_match(token, capability):
            return False
        self._recognised[job_id] = capability
        self._recognised.move_to_end(job_id)
        while len(self._recognised) > MAX_RECOGNISED_JOBS:
            self._recognised.popitem(last=False)
        return True

    def _is_a_known_jobs_capability(self, token: str) -> bool:
        jobs = self._gateway.live_job_ids() | set(self._recognised)
        # No early exit: the time taken does not depend on which job (if any) matched.
        matches = [tokens_match(token, self._capability(job_id)) for job_id in jobs]
        return any(matches)
