"""Operator endpoints: replay and cancel for admin tokens; explain and whoami for all.

(The jobs list is ``job_search``, the bulk actions ``bulk``.)

Replay and cancel are the same ``Operator`` actions as the CLI. The event they write names
the admin token that did it (``token#<id> (<label>)``), never the token itself. Account
tokens get 403 on every admin endpoint, even for their own jobs: those actions are for
operators. ``/explain`` follows the read rules of ``GET /v1/jobs/{jobId}`` (an account sees
only its own jobs; another account's job is a 404), and an account token reads the account
view (``admin.account_view``): the job's story without actors, hosts or operator notes.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Request, Response
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, ConfigDict, Field, field_validator

from jobrelay.admin.account_view import account_explain_document
from jobrelay.admin.explain import explain_document
from jobrelay.api.auth import Principal, PrincipalDep, bearer_scheme, hash_token
from jobrelay.api.bodies import MAX_BODY_BYTES, parse_body, read_body
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import ProblemError, problem_openapi
from jobrelay.api.ratelimit import RATE_LIMIT_RESPONSES, RateLimitedDep
from jobrelay.api.routes import PRUNED_RESPONSE, missing_job
from jobrelay.api.schemas import WireModel, canonical_job_id, valid_traceparent
from jobrelay.library.operator import Operator, refusal
from jobrelay.observe import tracing
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.admin import ActionOutcome, AdminQueries
from jobrelay.storage.queue_pauses import pause_of
from jobrelay.storage.store import JobRecord

INVALID_TRANSITION = "urn:jobrelay:problem:invalid-transition"
_NOT_FOUND = "no job with this id is visible to this token"

router = APIRouter()


def admin_responses(
    unavailable: str = "The database is unavailable; nothing was changed.",
) -> dict[int | str, dict[str, Any]]:
    """What any admin route may answer before its own work (every admin router's base)."""
    return {
        **RATE_LIMIT_RESPONSES,
        401: problem_openapi("No token, or not a valid one."),
        403: problem_openapi("Not an admin token."),
        503: problem_openapi(unavailable),
    }


_ADMIN_RESPONSES = admin_responses()
_ACTION_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_ADMIN_RESPONSES,
    404: problem_openapi("No such job."),
    410: PRUNED_RESPONSE,
    409: problem_openapi("The job is in a state this action may not move it from."),
    413: problem_openapi(f"The body is larger than {MAX_BODY_BYTES} bytes."),
    422: problem_openapi("Invalid body."),
}
JobIdPath = Annotated[str, Path(alias="jobId", description="The jobId returned by the 202.")]


class _Reasoned(WireModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("reason", check_fields=False)
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        if "\x00" in value:  # PostgreSQL cannot store it; SQLite would cut the text there
            raise ValueError("must not contain a NUL character")
        return value.strip()


class ReplayRequest(_Reasoned):
    reason: str = Field(default="replayed by an operator", min_length=1, max_length=500)


class CancelRequest(_Reasoned):
    reason: str = Field(min_length=1, max_length=500, description="Why; kept in the timeline.")


class ActionOut(WireModel):
    job_id: str
    action: str
    state: str
    previous_state: str
    actor: str
    cancel_requested: bool = Field(
        default=False,
        description="A running job's cancel was recorded (HTTP 202): its worker stops it and "
        "it ends `cancelled`; `state` is still `running` until then.",
    )


class WhoAmI(WireModel):
    account_id: str | None
    admin: bool


async def admin_actor(
    principal: RateLimitedDep,
    runtime: RuntimeDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> str:
    """The name of the admin token calling (for the audit trail); 403 for account tokens."""
    if not principal.is_admin or credentials is None:
        raise ProblemError(
            403, "this endpoint needs an admin token (jobrelay token create --admin)"
        )
    identity = await runtime.store.token_identity(hash_token(credentials.credentials))
    if identity is None:  # revoked between the two reads
        raise ProblemError(401, "the API token is not valid")
    token_id, label = identity
    return f"token#{token_id}" + (f" ({label})" if label else "")


AdminActor = Annotated[str, Depends(admin_actor)]


@router.get(
    "/v1/whoami",
    response_model=WhoAmI,
    summary="What this token may do",
    responses={
        401: problem_openapi("No token, or not a valid one."),
        503: problem_openapi("The database is unavailable."),
    },
)
async def whoami(principal: PrincipalDep) -> WhoAmI:
    return WhoAmI(account_id=principal.account_id, admin=principal.is_admin)


def body_of(model: type[BaseModel], required: bool) -> dict[str, Any]:
    """The request body as OpenAPI states it: parsed in the handler (after the token and the
    rate limit), as JSON whatever the Content-Type, at most MAX_BODY_BYTES."""
    schema = {"application/json": {"schema": _inlined(model.model_json_schema())}}
    return {"requestBody": {"required": required, "content": schema}}


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its local ``#/$defs/…`` references replaced by what they name: in
    the OpenAPI document they would point at its root, where there are no ``$defs``."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    out: dict[str, Any] = walk(schema)
    return out


@router.post(
    "/v1/jobs/{jobId}/replay",
    response_model=ActionOut,
    summary="Replay a quarantined job (admin)",
    responses=_ACTION_RESPONSES,
    openapi_extra=body_of(ReplayRequest, required=False),
)
async def replay_job(
    request: Request,
    job_id: JobIdPath,
    runtime: RuntimeDep,
    actor: AdminActor,
    principal: PrincipalDep,
    traceparent: Annotated[str | None, Header()] = None,
) -> ActionOut:
    """``quarantined -> queued`` with a fresh attempt budget; a new message goes through the
    outbox. The timeline gets a ``replayed`` event naming this token. The body is optional."""
    raw = await read_body(request)
    reason = (parse_body(ReplayRequest, raw) if raw.strip() else ReplayRequest()).reason
    trace = valid_traceparent(traceparent)
    return await _act(runtime, job_id, "replay", actor, reason, trace, principal)


@router.post(
    "/v1/jobs/{jobId}/cancel",
    response_model=ActionOut,
    summary="Cancel a job that has not finished (admin)",
    responses={
        **_ACTION_RESPONSES,
        202: {
            "description": "The job is running: the cancel is recorded (`cancelRequested`), "
            "its worker stops it and it ends `cancelled` with this reason.",
            "model": ActionOut,
        },
        409: problem_openapi("The job already finished (succeeded or cancelled)."),
    },
    openapi_extra=body_of(CancelRequest, required=True),
)
async def cancel_job(
    request: Request,
    response: Response,
    job_id: JobIdPath,
    runtime: RuntimeDep,
    actor: AdminActor,
    principal: PrincipalDep,
) -> ActionOut:
    """``queued | retry_wait | quarantined -> cancelled`` at once (200); later deliveries
    are acked without work. A ``running`` job's cancel is recorded (202): its worker learns
    it within ``JOBRELAY_CANCEL_CHECK_SECONDS``, stops the run and ends it ``cancelled``.
    The timeline gets a ``cancel_requested`` and then a ``cancelled`` event naming this
    token. A job that finished first is a 409."""
    body = parse_body(CancelRequest, await read_body(request))
    out = await _act(runtime, job_id, "cancel", actor, body.reason, None, principal)
    if out.cancel_requested:
        response.status_code = 202
    return out


@router.post(
    "/v1/jobs/{jobId}/resend",
    response_model=ActionOut,
    summary="Send a stuck queued job's work message again (admin)",
    responses=_ACTION_RESPONSES,
    openapi_extra=body_of(CancelRequest, required=True),
)
async def resend_job(
    request: Request,
    job_id: JobIdPath,
    runtime: RuntimeDep,
    actor: AdminActor,
    principal: PrincipalDep,
) -> ActionOut:
    """A ``queued`` job whose message was lost gets a new one through the outbox (no state
    change). The timeline gets a ``resent`` event naming this token; 409 in any other state."""
    body = parse_body(CancelRequest, await read_body(request))
    return await _act(runtime, job_id, "resend", actor, body.reason, None, principal)


@router.get(
    "/v1/jobs/{jobId}/explain",
    summary="A job explained: facts, attempts, timeline and where to look next",
    responses={
        200: {
            "description": (
                "The explanation: for an admin token the JSON of `jobrelay job show --json`; "
                "for an account token its account view (no workers, actors, operator notes "
                "or endpoints)."
            )
        },
        401: problem_openapi("No token, or not a valid one."),
        404: problem_openapi("No such job, or it belongs to another account (not distinguished)."),
        410: PRUNED_RESPONSE,
        503: problem_openapi("The database is unavailable."),
    },
)
async def explain_job(
    job_id: JobIdPath, principal: PrincipalDep, runtime: RuntimeDep
) -> dict[str, Any]:
    canonical = canonical_job_id(job_id)
    job = await runtime.store.get_job(canonical) if canonical else None
    if job is None or not principal.may_act_for(job.account_id):
        # Another account's job: the path of no job (routes._visible_job says why).
        raise await missing_job(runtime, principal, canonical)
    events = await runtime.store.events(job.id)
    trace_id = await AdminQueries(runtime.store).trace_id(job.id)
    links = await runtime.store.links_of(job.id)
    if principal.is_admin:
        pause = await pause_of(runtime.store, job.queue)
        return explain_document(
            job, events, runtime.clock(), trace_id, pause, links, runtime.settings.trace_url
        )
    return account_explain_document(job, events, runtime.clock(), trace_id, links)


async def _act(
    runtime: Runtime,
    raw_id: str,
    action: str,
    actor: str,
    reason: str,
    trace: str | None,
    principal: Principal,
) -> ActionOut:
    job_id = canonical_job_id(raw_id)
    if job_id is None:
        raise ProblemError(404, _NOT_FOUND)
    operator = Operator(runtime)
    outcome: ActionOutcome
    if action == "replay":
        # The replay's runs link to this request's trace (the caller's, when it sent one).
        headers = tracing.carrier() or None if trace else None
        outcome = await operator.replay(job_id, actor=actor, reason=reason, headers=headers)
    elif action == "resend":
        outcome = await operator.resend(job_id, actor=actor, reason=reason)
    else:
        outcome = await operator.cancel(job_id, actor=actor, reason=reason)
    if outcome.state is None:
        raise await missing_job(runtime, principal, job_id)
    if not outcome.done:
        raise ProblemError(
            409,
            refusal(action, outcome),
            type_=INVALID_TRANSITION,
            title="Not allowed in this state",
            state=outcome.state.value,
        )
    assert outcome.previous_state is not None
    return ActionOut(
        job_id=job_id,
        action=action,
        state=outcome.state.value,
        previous_state=outcome.previous_state.value,
        actor=actor,
        cancel_requested=outcome.requested,
    )


def _visible(principal: Principal, job: JobRecord | None) -> JobRecord:
    if job is None or not principal.may_act_for(job.account_id):
        raise ProblemError(404, _NOT_FOUND)
    return job
