"""``jobrelay quarantine purge``: take the stale copies out of the quarantine queue.

The quarantine queue is the broker-side surface of quarantined jobs; the database is the
truth. Once an operator replays or cancels a quarantined job, the copy its worker rejected
stays in the queue, and the reconciler reports it (``quarantine_mismatch``) for as long as it
is there. Such a copy is never consumed by anyone and decides nothing, so removing it loses
nothing. The purge removes exactly the copies whose job is no longer ``quarantined`` (any
other state, or deleted by retention) and keeps the rest: copies of jobs that are still
quarantined, and messages that name no job jobrelay knows, which are for a person to read.

Order matters: every message is taken (unacked) first, the jobs' states are read after, and
only then are the stale copies acked. A copy that arrived in the queue after the states were
read is not among those taken, so a job quarantined again meanwhile keeps its new copy. On
RabbitMQ, everything not acked goes back to the queue when the channel closes, as in the
reconciler's scan (``quarantine_scan``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from jobrelay.domain.states import JobState
from jobrelay.maintenance.quarantine_scan import (
    DeadLetter,
    death_reason,
    job_id_of,
    quarantine_channel,
    take_all,
    text_of,
)
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.admin import AdminQueries
from jobrelay.storage.local_queue import QUARANTINE as LOCAL_QUARANTINE
from jobrelay.storage.local_queue import REASON_HEADER as LOCAL_REASON_HEADER
from jobrelay.storage.repairs import RepairQueries
from jobrelay.transport.topology import QUARANTINE_QUEUE


@dataclass(frozen=True)
class Purged:
    job_id: str
    state: str  # the job's state, or "pruned"
    reason: str | None  # why the broker dead-lettered the copy


@dataclass
class PurgeReport:
    scanned: int = 0
    removed: list[Purged] = field(default_factory=list)
    kept_quarantined: int = 0  # copies of jobs still quarantined: the surface, kept
    kept_unknown: int = 0  # messages naming no job we know: for a person to read
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "scanned": self.scanned,
            "removed": [
                {"jobId": p.job_id, "state": p.state, "reason": p.reason} for p in self.removed
            ],
            "keptQuarantined": self.kept_quarantined,
            "keptUnknown": self.kept_unknown,
            "dryRun": self.dry_run,
        }


Decide = Callable[[list[DeadLetter]], Awaitable[list[Purged | None]]]


async def purge_quarantine(rt: Runtime, *, limit: int, dry_run: bool = False) -> PurgeReport:
    report = PurgeReport(dry_run=dry_run)

    async def decide(letters: list[DeadLetter]) -> list[Purged | None]:
        ids = [letter.job_id for letter in letters if letter.job_id is not None]
        states = await RepairQueries(rt.store).states_of(ids)
        pruned = await AdminQueries(rt.store).pruned_of([i for i in ids if i not in states])
        verdicts: list[Purged | None] = []
        for letter in letters:
            state = states.get(letter.job_id) if letter.job_id else None
            if letter.job_id is not None and letter.job_id in pruned:
                verdicts.append(Purged(letter.job_id, "pruned", letter.reason))
            elif letter.job_id is None or state is None:
                report.kept_unknown += 1
                verdicts.append(None)
            elif state is JobState.QUARANTINED:
                report.kept_quarantined += 1
                verdicts.append(None)
            else:
                verdicts.append(Purged(letter.job_id, state.value, letter.reason))
        report.scanned = len(letters)
        report.removed = [v for v in verdicts if v is not None]
        return verdicts

    if rt.settings.uses_local_broker:
        await _purge_local(rt, limit, dry_run, decide)
    else:
        await _purge_rabbitmq(rt.settings.broker_url, limit, dry_run, decide)
    return report


async def _purge_local(rt: Runtime, limit: int, dry_run: bool, decide: Decide) -> None:
    queries = AdminQueries(rt.store)
    messages = await queries.local_queue_messages(LOCAL_QUARANTINE, limit)
    letters = [
        DeadLetter(job_id_of(m.headers, m.body), text_of(m.headers.get(LOCAL_REASON_HEADER)))
        for m in messages
    ]
    verdicts = await decide(letters)
    stale = [m.id for m, v in zip(messages, verdicts, strict=True) if v is not None]
    if not dry_run:
        await queries.delete_local_messages(LOCAL_QUARANTINE, stale)


async def _purge_rabbitmq(url: str, limit: int, dry_run: bool, decide: Decide) -> None:
    async with quarantine_channel(url, "purge") as (channel, queue):
        held = await take_all(queue, limit)
        letters = [
            DeadLetter(job_id_of(dict(m.headers or {}), m.body), death_reason(m.headers or {}))
            for m in held
        ]
        verdicts = await decide(letters)
        if dry_run:
            return
        for message, verdict in zip(held, verdicts, strict=True):
            if verdict is not None:
                await message.ack()
        # A synchronous method after the acks: the broker handles a channel's frames in
        # order, so once this answers every ack above has been applied. The rest go back to
        # the queue when the channel closes.
        await channel.declare_queue(QUARANTINE_QUEUE, passive=True)
