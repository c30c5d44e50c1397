"""Limits per key as operators see and change them: the overview, and audited overrides.

An override replaces a declared limit at run time (``domain.limits.effective``: an override
of one key's id beats one of the whole limit's name), read by the relay's next admission
round, so raising a limit on a hot key takes effect without a deploy. A set or a clear is one
transaction: the ``limit_overrides`` row and a ``limit_events`` row naming the actor, the
reason and the values before and after. The overview is aggregated in the database (a
``GROUP BY`` over the unfinished limited jobs' ``limits`` text, and over ``job_slots``), not
read job by job: a backlog of a hot key is many jobs and few groups.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Text, cast, delete, func, insert, select

from jobrelay.domain.limits import (
    CONCURRENCY,
    KEY_MAX,
    PRIORITY_PREFIX,
    RATE,
    JobLimit,
    LimitError,
    Override,
    effective,
    limit_id,
    split_id,
)
from jobrelay.storage.port import StorePort
from jobrelay.storage.tables import job_slots, jobs, limit_events, limit_overrides
from jobrelay.storage.transitions import awaiting_admission, unfinished

NAME_MAX = 64  # a job type's or a limit's name (``library.limits``)


@dataclass(frozen=True)
class LimitOverride:
    limit_id: str
    max: int | None
    per_second: float | None
    burst: float | None
    changed_at: datetime
    changed_by: str
    reason: str

    def values(self) -> dict[str, Any]:
        return {"max": self.max, "perSecond": self.per_second, "burst": self.burst}


@dataclass(frozen=True)
class LimitRow:
    """One limit id of one kind: what the code declared (as its unfinished jobs carry it), the
    override that applies, and its jobs: admitted and unfinished (``running``: for a
    concurrency limit, the slots held), and awaiting admission (``waiting``, oldest since)."""

    limit_id: str
    kind: str
    declared: JobLimit | None
    override: LimitOverride | None
    running: int
    waiting: int
    oldest_wait: datetime | None

    @property
    def name(self) -> str:
        return split_id(self.limit_id)[0]

    @property
    def key(self) -> str | None:
        return split_id(self.limit_id)[1]

    @property
    def current(self) -> JobLimit | None:
        """The limit as the relay applies it now (declared, then overridden)."""
        o = self.override
        if o is None:
            return self.declared
        # No job declares it yet: the override's value alone (it sets one of this kind).
        base = self.declared or JobLimit(self.limit_id, self.kind, max=0, per_second=0, burst=0)
        return effective(base, {o.limit_id: Override(o.max, o.per_second, o.burst)})


@dataclass(frozen=True)
class LimitEvent:
    limit_id: str
    at: datetime
    kind: str
    detail: dict[str, Any]
    actor: str
    reason: str


def target(name: str, key: str | None) -> str:
    """The limit id an operator names (a whole limit, or one key's), checked."""
    if not name or len(name) > NAME_MAX or "\x1f" in name or "\x00" in name:
        raise LimitError(f"a limit's name is text of 1 to {NAME_MAX} characters")
    if key is not None and (not key or len(key) > KEY_MAX or "\x1f" in key or "\x00" in key):
        raise LimitError(f"a key is text of 1 to {KEY_MAX} characters")
    if name.startswith(PRIORITY_PREFIX):
        # Its bound is a setting: an override would be stored and do nothing.
        raise LimitError(
            f"{name} orders a prioritized queue and has no value to override: "
            "JOBRELAY_PRIORITY_AHEAD bounds how many of its jobs the broker holds"
        )
    return limit_id(name, key)


def _override(row: Any) -> LimitOverride:
    return LimitOverride(
        row.limit_id, row.max, row.per_second, row.burst, row.changed_at, row.changed_by, row.reason
    )


async def overrides(store: StorePort) -> dict[str, LimitOverride]:
    async with store.reading() as conn:
        rows = (await conn.execute(select(limit_overrides))).all()
    return {r.limit_id: _override(r) for r in rows}


def _limits_of(text: str | None) -> list[JobLimit]:
    try:
        return [JobLimit.from_json(item) for item in json.loads(text or "null") or ()]
    except (ValueError, KeyError, TypeError):
        return []  # a row no version of the code wrote: not shown rather than a 500


async def limits_overview(store: StorePort) -> list[LimitRow]:
    """Every limit id of an unfinished job, and every override, sorted by name and key."""
    text = cast(jobs.c.limits, Text)
    async with store.reading() as conn:
        waiting_rows = (
            await conn.execute(
                select(
                    text.label("limits"),
                    func.count().label("n"),
                    func.min(func.coalesce(jobs.c.throttled_at, jobs.c.created_at)).label("since"),
                )
                .where(awaiting_admission())
                .group_by(text)
            )
        ).all()
        admitted_rows = (
            await conn.execute(
                select(text.label("limits"), func.count().label("n"))
                .where(
                    jobs.c.limits.is_not(None),
                    jobs.c.admitted_at.is_not(None),
                    unfinished(),
                )
                .group_by(text)
            )
        ).all()
        slots = {
            r.limit_id: int(r.n)
            for r in await conn.execute(
                select(job_slots.c.limit_id, func.count().label("n")).group_by(job_slots.c.limit_id)
            )
        }
        found = {r.limit_id: _override(r) for r in await conn.execute(select(limit_overrides))}
    declared: dict[tuple[str, str], JobLimit | None] = {}
    waiting: dict[tuple[str, str], int] = {}
    oldest: dict[tuple[str, str], datetime] = {}
    admitted: dict[tuple[str, str], int] = {}
    for row in waiting_rows:
        for limit in _limits_of(row.limits):
            at = (limit.limit_id, limit.kind)
            declared.setdefault(at, limit)
            waiting[at] = waiting.get(at, 0) + int(row.n)
            if row.since is not None and (at not in oldest or row.since < oldest[at]):
                oldest[at] = row.since
    for row in admitted_rows:
        for limit in _limits_of(row.limits):
            at = (limit.limit_id, limit.kind)
            declared.setdefault(at, limit)
            admitted[at] = admitted.get(at, 0) + int(row.n)
    seen = {i for i, _ in declared} | {split_id(i)[0] for i, _ in declared}
    for ident, override in found.items():  # an override no unfinished job is under yet
        for kind, value in ((CONCURRENCY, override.max), (RATE, override.per_second)):
            if value is not None and ident not in seen:
                declared[(ident, kind)] = None
    rows = []
    for (ident, kind), as_declared in declared.items():
        applies = found.get(ident) or found.get(split_id(ident)[0])
        if (
            applies is not None
            and (applies.max if kind == CONCURRENCY else applies.per_second) is None
        ):
            applies = None  # it overrides the other kind only: not this limit
        running = slots.get(ident, 0) if kind == CONCURRENCY else admitted.get((ident, kind), 0)
        rows.append(
            LimitRow(
                ident,
                kind,
                as_declared,
                applies,
                running,
                waiting.get((ident, kind), 0),
                oldest.get((ident, kind)),
            )
        )
    return sorted(rows, key=lambda r: (r.name, r.key or "", r.kind))


def _checked(max: int | None, per_second: float | None, burst: float | None) -> None:
    if (max is None) == (per_second is None):
        raise LimitError("give exactly one of a concurrency (max) and a rate")
    if max is not None and (isinstance(max, bool) or not isinstance(max, int) or max < 1):
        raise LimitError(f"a concurrency must be a whole number >= 1, got {max!r}")
    if per_second is not None and not per_second > 0:
        raise LimitError("a rate must be above 0")
    if burst is not None and (per_second is None or not burst >= 1):
        raise LimitError("a burst (>= 1) goes with a rate only")


async def set_override(
    store: StorePort,
    limit: str,
    *,
    max: int | None = None,
    per_second: float | None = None,
    burst: float | None = None,
    actor: str,
    reason: str,
    now: datetime,
) -> LimitOverride:
    """Override ``limit`` (an id from ``target``): its concurrency (``max``) or its rate
    (``per_second``, ``burst``: None for one second's worth); an override of the other kind
    on the same id is kept. Raises ``LimitError`` (nothing written) on values that cannot be."""
    _checked(max, per_second, burst)
    async with store.writing() as conn:
        row = (
            await conn.execute(
                select(limit_overrides).where(limit_overrides.c.limit_id == limit).with_for_update()
            )
        ).first()
        old = _override(row) if row is not None else None
        values: dict[str, Any] = {
            "max": old.max if old else None,
            "per_second": old.per_second if old else None,
            "burst": old.burst if old else None,
        }
        if max is not None:
            values["max"] = max
        else:
            values["per_second"], values["burst"] = per_second, burst
        values |= {"changed_at": now, "changed_by": actor, "reason": reason}
        upsert = store.upsert(limit_overrides).values(limit_id=limit, **values)
        await conn.execute(upsert.on_conflict_do_update(index_elements=["limit_id"], set_=values))
        new = LimitOverride(limit, **values)
        detail = {"old": old.values() if old else None, "new": new.values()}
        await conn.execute(
            insert(limit_events).values(
                limit_id=limit, at=now, kind="set", detail=detail, actor=actor, reason=reason
            )
        )
    return new


async def clear_override(
    store: StorePort, limit: str, *, actor: str, reason: str, now: datetime
) -> LimitOverride | None:
    """Remove ``limit``'s override (the declared values hold again at the next admission
    round); the override removed, or None (and nothing written) when there was none."""
    async with store.writing() as conn:
        row = (
            await conn.execute(
                select(limit_overrides).where(limit_overrides.c.limit_id == limit).with_for_update()
            )
        ).first()
        if row is None:
            return None
        old = _override(row)
        await conn.execute(delete(limit_overrides).where(limit_overrides.c.limit_id == limit))
        await conn.execute(
            insert(limit_events).values(
                limit_id=limit,
                at=now,
                kind="cleared",
                detail={"old": old.values()},
                actor=actor,
                reason=reason,
            )
        )
    return old


async def limit_history(store: StorePort, limit: str, count: int = 50) -> list[LimitEvent]:
    """The overrides set and cleared on ``limit``, newest first."""
    query = (
        select(limit_events)
        .where(limit_events.c.limit_id == limit)
        .order_by(limit_events.c.id.desc())
        .limit(count)
    )
    async with store.reading() as conn:
        rows = (await conn.execute(query)).all()
    return [LimitEvent(r.limit_id, r.at, r.kind, dict(r.detail), r.actor, r.reason) for r in rows]


__all__ = [
    "LimitEvent",
    "LimitOverride",
    "LimitRow",
    "clear_override",
    "limit_history",
    "limits_overview",
    "overrides",
    "set_override",
    "target",
]
