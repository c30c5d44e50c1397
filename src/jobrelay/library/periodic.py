"""Periodic jobs of an ``App``: what ``app.schedule(...)`` and ``@app.job(schedule=...)`` define.

A ``Schedule`` names a job type, a cron expression in a time zone, and the parameters of
every tick's job. It is checked when it is defined (the cron expression, the zone, and the
parameters against the job's model), so a typo fails at import, not at 2 a.m. The
schedulers (``maintenance/scheduler.py``) turn its ticks into jobs: each tick's job is keyed by the
schedule's name and the tick's instant, so however many schedulers run, a tick is one job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from jobrelay.domain.ids import IdKeys
from jobrelay.domain.schedules import TICK_FIELD, Cron, check_cron, check_name, tick_key, zone
from jobrelay.errors import ConfigError, InvalidParams
from jobrelay.storage.records import NewJob

if TYPE_CHECKING:
    from jobrelay.library.job_definition import JobDefinition


@dataclass(frozen=True)
class Schedule:
    name: str
    job: JobDefinition[Any]
    cron: Cron
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def job_type(self) -> str:
        return self.job.type

    @property
    def takes_tick(self) -> bool:
        """Whether the job's parameters have a ``scheduled_at`` field (set to the tick)."""
        return TICK_FIELD in self.job.params_model.model_fields

    def tick_params(self, tick: datetime) -> dict[str, Any]:
        params = dict(self.params)
        if self.takes_tick:
            params[TICK_FIELD] = tick.astimezone(UTC).isoformat()
        return params

    def tick_job(self, tick: datetime, keys: IdKeys) -> NewJob:
        """The job of one tick: keyed by this schedule's name and the tick, on no account;
        its id keyed with the installation's ``keys`` (``Store.id_keys``)."""
        return self.job.new_job(self.tick_params(tick), key=tick_key(self.name, tick), keys=keys)


def define_schedule(
    job: JobDefinition[Any],
    *,
    cron: str,
    params: Mapping[str, Any] | None,
    timezone: str,
    name: str | None,
    where: str,
) -> Schedule:
    """A checked ``Schedule``; any mistake is a ``ConfigError`` naming ``where``."""
    try:
        schedule = Schedule(
            name=check_name(name or job.type),
            job=job,
            cron=Cron(check_cron(cron), timezone),
            params=dict(params or {}),
        )
        zone(timezone)
    except ValueError as exc:
        raise ConfigError(where, str(exc)) from None
    if TICK_FIELD in schedule.params:
        raise ConfigError(where, f"{TICK_FIELD!r} is set by the scheduler to each tick's time")
    try:
        schedule.job.parse(schedule.tick_params(datetime(2000, 1, 1, tzinfo=UTC)))
    except InvalidParams as exc:
        raise ConfigError(where, f"schedule {schedule.name!r}: {exc}") from None
    return schedule
