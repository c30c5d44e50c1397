"""Limits per key for operators: what each limit holds back, and overriding one (admin).

``GET /v1/limits`` lists every limit id an unfinished job is under (and every override): its
declared value, the override that applies, the jobs admitted and unfinished (``running``:
for a concurrency limit, the slots held) and those awaiting admission (``waiting``, the
oldest since when); and per limit its totals over all its keys (``groups``), so that the
console's limits panel, with ``?top=10``, reads each limit's hottest keys and a count of the
rest rather than adding up an unbounded list. ``PUT /v1/limits/{name}`` sets an override (of
the whole limit, or of one ``key``): a concurrency or a rate, with a required reason,
audited in ``limit_events`` with the admin token's name; the relay applies it from its next
admission round, no deploy.
``DELETE /v1/limits/{name}?key=`` removes it (a reason in the body, like a queue's resume).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import Field, field_validator, model_validator

from jobrelay.api.admin import AdminActor, _Reasoned, admin_responses, body_of
from jobrelay.api.bodies import MAX_BODY_BYTES, parse_body, read_body
from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import ProblemError, ValidationProblem, problem_openapi
from jobrelay.api.schemas import WireModel
from jobrelay.domain.limits import (
    CONCURRENCY,
    KEY_MAX,
    JobLimit,
    LimitError,
    parse_rate,
    split_id,
)
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.limit_overrides import (
    NAME_MAX,
    LimitOverride,
    LimitRow,
    clear_override,
    limits_overview,
    overrides,
    set_override,
    target,
)

router = APIRouter()

_READ = admin_responses("The database is unavailable.")
_ACT: dict[int | str, dict[str, Any]] = {
    **_READ,
    404: problem_openapi("No such route (a name cannot contain '/'), or nothing to remove."),
    413: problem_openapi(f"The body is larger than {MAX_BODY_BYTES} bytes."),
    422: problem_openapi(
        "Invalid body: a reason is required, and exactly one of concurrency and rate.",
        ValidationProblem,
    ),
}
NamePath = Annotated[
    str,
    Path(
        min_length=1, max_length=NAME_MAX, description="A limit's name (its job type's, or name=)."
    ),
]
TopQuery = Annotated[
    int | None,
    Query(
        ge=1,
        le=100,
        description="List only each limit's N keys with the most waiting (then running); "
        "`groups` counts the rest. None: every key.",
    ),
]
KeyQuery = Annotated[
    str | None,
    Query(min_length=1, max_length=KEY_MAX, description="One key's override; none: the limit's."),
]


def _no_separator(value: str | None) -> str | None:
    if value is not None and ("\x1f" in value or "\x00" in value):
        raise ValueError("must not contain a control character \\x1f or NUL")
    return value


class LimitChange(_Reasoned):
    key: str | None = Field(default=None, min_length=1, max_length=KEY_MAX)
    concurrency: int | None = Field(default=None, ge=1, le=1_000_000)
    rate: str | None = Field(default=None, max_length=64, examples=["30/minute"])
    burst: int | None = Field(default=None, ge=1, le=1_000_000)
    reason: str = Field(min_length=1, max_length=500, description="Why; kept in the audit.")

    @field_validator("key")
    @classmethod
    def _key(cls, value: str | None) -> str | None:
        return _no_separator(value)

    @field_validator("rate")
    @classmethod
    def _rate(cls, value: str | None) -> str | None:
        if value is not None:
            parse_rate(value)  # a LimitError is a ValueError: a 422 naming the field
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> LimitChange:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency and rate")
        if self.burst is not None and self.rate is None:
            raise ValueError("burst goes with a rate only")
        return self


class LimitReason(_Reasoned):
    reason: str = Field(min_length=1, max_length=500, description="Why; kept in the audit.")


class LimitValue(WireModel):
    max: int | None = None
    per_second: float | None = None
    burst: float | None = None


class OverrideOut(WireModel):
    limit: str
    key: str | None
    max: int | None = Field(description="The concurrency it sets, if it sets one.")
    per_second: float | None = Field(description="The rate it sets, if it sets one.")
    burst: float | None = Field(description="Its rate's burst; null: one second's worth.")
    changed_at: datetime
    changed_by: str
    reason: str


class LimitOut(WireModel):
    limit: str
    key: str | None
    kind: str = Field(description="concurrency or rate")
    declared: LimitValue | None = Field(description="As its unfinished jobs were enqueued.")
    override: OverrideOut | None = Field(description="Of this key, else of the whole limit.")
    current: LimitValue | None = Field(description="What the relay applies now.")
    running: int = Field(description="Admitted, unfinished (concurrency: the slots held).")
    waiting: int = Field(description="Awaiting admission.")
    waiting_since: datetime | None = Field(description="The oldest waiting job's wait.")
    waiting_seconds: float | None = Field(
        default=None, description="How long it has waited, by the server's clock."
    )


class LimitGroupOut(WireModel):
    limit: str
    kind: str = Field(description="concurrency, rate or fair")
    keys: int = Field(description="Its keys listed or not (0: a limit without a key).")
    declared: list[LimitValue] = Field(
        description="The values its unfinished jobs carry (two after a deploy changed it)."
    )
    override: OverrideOut | None = Field(description="The whole limit's, of this kind.")
    running: int = Field(description="Over all its keys.")
    waiting: int = Field(description="Over all its keys.")
    waiting_since: datetime | None = Field(description="The oldest wait of any of its keys.")
    waiting_seconds: float | None = Field(description="Its age, by the server's clock.")
    other_keys: int = Field(description="Keys not in `limits` (beyond `top`).")
    other_running: int = Field(description="Running under the keys not listed.")
    other_waiting: int = Field(description="Waiting under the keys not listed.")


class LimitsOut(WireModel):
    limits: list[LimitOut]
    groups: list[LimitGroupOut] = Field(
        default_factory=list, description="Per limit (name and kind), sorted by name."
    )


def _value(limit: JobLimit | None) -> LimitValue | None:
    if limit is None:
        return None
    return LimitValue(max=limit.max, per_second=limit.per_second, burst=limit.burst)


def override_out(o: LimitOverride) -> OverrideOut:
    name, key = split_id(o.limit_id)
    return OverrideOut(
        limit=name,
        key=key,
        max=o.max,
        per_second=o.per_second,
        burst=o.burst,
        changed_at=o.changed_at,
        changed_by=o.changed_by,
        reason=o.reason,
    )


def _age(since: datetime | None, now: datetime) -> float | None:
    return None if since is None else max(0.0, (now - since).total_seconds())


def _row(r: LimitRow, now: datetime) -> LimitOut:
    return LimitOut(
        limit=r.name,
        key=r.key,
        kind=r.kind,
        declared=_value(r.declared),
        override=override_out(r.override) if r.override else None,
        current=_value(r.current),
        running=r.running,
        waiting=r.waiting,
        waiting_since=r.oldest_wait,
        waiting_seconds=_age(r.oldest_wait, now),
    )


def _hottest(r: LimitRow) -> tuple[int, int, float, str]:
    """The keys a panel lists first: the most waiting, then running, then the oldest wait."""
    since = r.oldest_wait.timestamp() if r.oldest_wait else float("inf")
    return (-r.waiting, -r.running, since, r.key or "")


def _group(
    rows: list[LimitRow], found: dict[str, LimitOverride], top: int | None, now: datetime
) -> tuple[LimitGroupOut, list[LimitRow]]:
    """One limit's totals, and the rows listed for it: all, or its ``top`` hottest keys (the
    row of its jobs without a key, if any, always: it is the limit's own, not a key's)."""
    name, kind = rows[0].name, rows[0].kind
    keyed = sorted((r for r in rows if r.key is not None), key=_hottest)
    shown = keyed if top is None else keyed[:top]
    rest = keyed[len(shown) :]
    since = [r.oldest_wait for r in rows if r.oldest_wait is not None]
    declared: list[LimitValue] = []
    for r in rows:
        value = _value(r.declared)
        if value is not None and value not in declared:
            declared.append(value)
    whole = found.get(name)
    if whole is not None and (whole.max if kind == CONCURRENCY else whole.per_second) is None:
        whole = None  # it overrides the limit's other kind only
    group = LimitGroupOut(
        limit=name,
        kind=kind,
        keys=len(keyed),
        declared=declared,
        override=override_out(whole) if whole else None,
        running=sum(r.running for r in rows),
        waiting=sum(r.waiting for r in rows),
        waiting_since=min(since) if since else None,
        waiting_seconds=_age(min(since), now) if since else None,
        other_keys=len(rest),
        other_running=sum(r.running for r in rest),
        other_waiting=sum(r.waiting for r in rest),
    )
    return group, [r for r in rows if r.key is None] + shown


async def limit_rows(runtime: Runtime, top: int | None = None) -> LimitsOut:
    """Every limit id's row (``top``: only each limit's ``top`` hottest keys), and per limit
    its totals over all its keys: the rows are grouped here, in the server, so that a page
    showing a limit with thousands of keys reads a bounded answer."""
    rows = await limits_overview(runtime.store)
    found = await overrides(runtime.store)
    now = runtime.clock()
    by_limit: dict[tuple[str, str], list[LimitRow]] = {}
    for r in rows:
        by_limit.setdefault((r.name, r.kind), []).append(r)
    groups, listed = [], []
    for at in sorted(by_limit):
        group, shown = _group(by_limit[at], found, top, now)
        groups.append(group)
        listed.extend(shown)
    if top is None:
        listed = rows  # every row, as before: sorted by name and key
    return LimitsOut(limits=[_row(r, now) for r in listed], groups=groups)


def _target(name: str, key: str | None, key_at: tuple[str, str]) -> str:
    """The limit id named, or a 422 naming the parameter, as any validation problem."""
    for given, loc in ((None, ("path", "name")), (key, key_at)):
        try:
            ident = target(name, given)
        except LimitError as exc:
            error = {"type": "value_error", "loc": loc, "msg": str(exc)}
            raise RequestValidationError([error]) from None
    return ident


@router.get(
    "/v1/limits",
    response_model=LimitsOut,
    summary="Limits per key: declared, overridden, running, waiting for admission (admin)",
    responses={
        **_READ,
        422: problem_openapi(
            "Invalid query: `top` is a whole number from 1 to 100.", ValidationProblem
        ),
    },
)
async def list_limits(runtime: RuntimeDep, actor: AdminActor, top: TopQuery = None) -> LimitsOut:
    return await limit_rows(runtime, top)


@router.put(
    "/v1/limits/{name}",
    response_model=OverrideOut,
    summary="Override a limit (or one key's) at run time: a concurrency or a rate (admin)",
    responses=_ACT,
    openapi_extra=body_of(LimitChange, required=True),
)
async def set_limit(
    request: Request, name: NamePath, runtime: RuntimeDep, actor: AdminActor
) -> OverrideOut:
    body = parse_body(LimitChange, await read_body(request))
    ident = _target(name, body.key, ("body", "key"))
    per_second: float | None = None
    if body.rate is not None:
        count, period = parse_rate(body.rate)
        per_second = count / period
    override = await set_override(
        runtime.store,
        ident,
        max=body.concurrency,
        per_second=per_second,
        burst=None if body.burst is None else float(body.burst),
        actor=actor,
        reason=body.reason,
        now=runtime.clock(),
    )
    return override_out(override)


@router.delete(
    "/v1/limits/{name}",
    response_model=OverrideOut,
    summary="Remove a limit's override: the declared value holds again (admin)",
    responses=_ACT,
    openapi_extra=body_of(LimitReason, required=True),
)
async def clear_limit(
    request: Request, name: NamePath, runtime: RuntimeDep, actor: AdminActor, key: KeyQuery = None
) -> OverrideOut:
    body = parse_body(LimitReason, await read_body(request))
    ident = _target(name, key, ("query", "key"))
    removed = await clear_override(
        runtime.store, ident, actor=actor, reason=body.reason, now=runtime.clock()
    )
    if removed is None:
        raise ProblemError(404, "no override of this limit to remove")
    return override_out(removed)
