"""The operator's verbs — replay, cancel, resend, bulk replay, pause and resume a queue — written
once for the CLI, the admin HTTP API and the application's ``App`` (``await app.cancel(...)``).

Each action is one guarded transition from ``domain.states`` (``by="operator"``) with its
event, carrying ``actor`` (who did it) and ``reason``, in the same transaction; a replay's
new work message is an outbox row in that transaction too, so the relay sends it like any
other. An action that finds the job in a state it may not move from changes nothing and
returns the state it found; ``refusal()`` turns that into one sentence for a person. Every
action that changed something is counted (``jobrelay_operator_actions_total``) and logged
(``jobrelay.operator``) the same way whoever called it.

It runs on an ``OperatorSite``: a process's ``Runtime``, or what an ``App`` has without one
(its store, clock, metrics and itself).
"""

from __future__ import annotations

import getpass
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from jobrelay.domain.states import JobState, sources_for
from jobrelay.errors import JobrelayError
from jobrelay.settings import Settings
from jobrelay.storage.admin import ActionOutcome, AdminQueries
from jobrelay.storage.queue_pauses import set_paused
from jobrelay.storage.repairs import RepairQueries
from jobrelay.storage.store import JobRecord

if TYPE_CHECKING:
    from jobrelay.observe.metrics import Metrics
    from jobrelay.storage.port import StorePort

log = logging.getLogger("jobrelay.operator")

REPLAYABLE = sources_for(JobState.QUEUED, by="operator")
CANCELLABLE = sources_for(JobState.CANCELLED, by="operator")


class JobTypes(Protocol):
    """An application's job types (``App``): what a replay's attempt budget is read from."""

    @property
    def jobs(self) -> Mapping[str, Any]: ...


class OperatorSite(Protocol):
    """What the verbs need: a ``Runtime`` has it, and so does an ``App`` without one."""

    @property
    def settings(self) -> Settings: ...

    @property
    def store(self) -> StorePort: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def clock(self) -> Callable[[], datetime]: ...

    def job_app(self) -> JobTypes: ...


class UnknownQueue(JobrelayError):
    """A queue the application does not have (nothing was changed)."""

    def __init__(self, queue: str, known: Sequence[str]) -> None:
        super().__init__(f"no queue {queue!r} in this app (its queues: {', '.join(known)})")
        self.queue = queue


def cli_actor() -> str:
    """Who runs this CLI: ``cli:<user>@<host>``."""
    return f"cli:{_user()}@{socket.gethostname()}"


def app_actor() -> str:
    """Who calls an ``App`` verb without naming an actor: ``app:<user>@<host>``."""
    return f"app:{_user()}@{socket.gethostname()}"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER (some containers)
        return "unknown"


def refusal(action: str, outcome: ActionOutcome) -> str:
    """Why ``action`` did nothing, for a person."""
    if outcome.state is None:
        return f"no job {outcome.job_id}"
    if action == "resend":
        return f"job {outcome.job_id} is {outcome.state.value}; resend is allowed only from queued"
    if action == "cancel" and outcome.state.is_terminal and outcome.state not in CANCELLABLE:
        return f"job {outcome.job_id} already {outcome.state.value}; nothing to cancel"
    allowed = ", ".join(
        sorted(s.value for s in (REPLAYABLE if action == "replay" else CANCELLABLE))
    )
    return f"job {outcome.job_id} is {outcome.state.value}; {action} is allowed only from {allowed}"


@dataclass
class BulkReplay:
    matched: list[JobRecord]
    replayed: list[str] = field(default_factory=list)
    skipped: list[ActionOutcome] = field(default_factory=list)  # changed state meanwhile
    dry_run: bool = False


class Operator:
    def __init__(self, rt: OperatorSite) -> None:
        self.rt = rt
        self.queries = AdminQueries(rt.store)

    async def replay(
        self, job_id: str, *, actor: str, reason: str, headers: dict[str, str] | None = None
    ) -> ActionOutcome:
        """A quarantined job back to ``queued`` with a fresh budget of its type's
        ``max_attempts`` more attempts (``JOBRELAY_MAX_ATTEMPTS`` for a type this app does not
        define), through the outbox."""
        outcome = await self.queries.replay(
            job_id,
            actor=actor,
            reason=reason,
            budget=self.attempt_budget,
            now=self.rt.clock(),
            headers=headers,
        )
        self._record("replay", outcome, actor, reason)
        return outcome

    def attempt_budget(self, job_type: str) -> int:
        """What a replay grants: the type's own ``max_attempts``, so a type declared with 10
        attempts is not replayed with the global 3."""
        definition = self.rt.job_app().jobs.get(job_type)
        settings = self.rt.settings
        return (
            settings.max_attempts if definition is None else definition.max_attempts_under(settings)
        )

    async def cancel(self, job_id: str, *, actor: str, reason: str) -> ActionOutcome:
        """queued | retry_wait | quarantined -> cancelled at once; a running job's cancel is
        recorded (``requested``), its worker stops it and ends it ``cancelled``
        (``storage.cancels``). A job that finished first is refused, as it is."""
        for _ in range(3):  # the job may move between the two guarded writes: look again
            now = self.rt.clock()
            outcome = await self.queries.cancel(job_id, actor=actor, reason=reason, now=now)
            if outcome.done or outcome.state is not JobState.RUNNING:
                break
            asked = await self.rt.store.request_cancel(job_id, actor=actor, reason=reason, now=now)
            if asked.requested:
                running = JobState.RUNNING
                outcome = ActionOutcome(job_id, True, running, running, requested=True)
                break
            outcome = ActionOutcome(job_id, False, asked.state)
            if asked.state is None or asked.state.is_terminal:
                break
        self._record("cancel", outcome, actor, reason)
        return outcome

    async def bulk_replay(
        self,
        *,
        actor: str,
        reason_filter: str | None,
        job_type: str | None,
        dry_run: bool = False,
        limit: int = 1000,
    ) -> BulkReplay:
        """Replay every quarantined job whose reason contains ``reason_filter`` (any case) and
        whose type is ``job_type``; each job is its own guarded transaction."""
        matched = await self.queries.find_jobs(
            state=JobState.QUARANTINED, reason=reason_filter, job_type=job_type, limit=limit
        )
        result = BulkReplay(matched=matched, dry_run=dry_run)
        if dry_run:
            return result
        note = "bulk replay of quarantined jobs"
        if reason_filter:
            note += f" with reason containing {reason_filter!r}"
        if job_type:
            note += f" of type {job_type}"
        for job in matched:
            outcome = await self.replay(job.id, actor=actor, reason=note)
            if outcome.done:
                result.replayed.append(job.id)
            else:
                result.skipped.append(outcome)
        return result

    async def resend(self, job_id: str, *, actor: str, reason: str) -> ActionOutcome:
        """Send a ``queued`` job's work message again (its message was lost or
        dead-lettered): an outbox row and a ``resent`` event; refused in any other state."""
        outcome = await RepairQueries(self.rt.store).resend_queued(
            job_id, actor=actor, reason=reason, now=self.rt.clock()
        )
        if outcome.done:
            self.rt.metrics.operator_actions.labels(action="resend").inc()
        log.info(
            "job resent by %s" if outcome.done else "resend refused by %s",
            actor,
            extra={
                "event": "resent" if outcome.done else "resend_refused",
                "jobId": job_id,
                "actor": actor,
                "reason": reason,
            },
        )
        return outcome

    def _record(self, action: str, outcome: ActionOutcome, actor: str, reason: str) -> None:
        event = "replayed" if action == "replay" else "cancelled"
        if outcome.requested:
            self.rt.metrics.operator_actions.labels(action=action).inc()
            log.info(
                "cancel of a running job requested by %s",
                actor,
                extra={"event": "cancel_requested", "jobId": outcome.job_id, "actor": actor},
            )
        elif outcome.done:
            assert outcome.previous_state is not None and outcome.state is not None
            self.rt.metrics.operator_actions.labels(action=action).inc()
            self.rt.metrics.transition(outcome.previous_state.value, outcome.state.value)
            log.info(
                "job %s by %s",
                event,
                actor,
                extra={"event": event, "jobId": outcome.job_id, "actor": actor, "reason": reason},
            )
        else:
            log.info(
                "%s refused: %s",
                action,
                refusal(action, outcome),
                extra={"event": f"{action}_refused", "jobId": outcome.job_id, "actor": actor},
            )


async def set_queue_paused(
    rt: OperatorSite, queue: str, paused: bool, *, actor: str, reason: str, queues: Sequence[str]
) -> bool:
    """Pause (or resume) ``queue``, one of the application's ``queues`` (``UnknownQueue``
    else); False when it already was. Workers learn of it within
    ``JOBRELAY_QUEUE_PAUSE_POLL_SECONDS``; what they hold finishes."""
    if queue not in queues:
        raise UnknownQueue(queue, queues)
    action = "pause" if paused else "resume"
    changed = await set_paused(rt.store, queue, paused, actor=actor, reason=reason, now=rt.clock())
    if changed:
        rt.metrics.operator_actions.labels(action=action).inc()
    # Named apart from the workers' ``queue_paused``/``queue_resumed`` (each worker's line
    # when it notices): one change, one operator line.
    log.info(
        "queue %s %s by %s" if changed else "queue %s already %s (%s)",
        queue,
        ("paused" if paused else "resumed") if changed else ("paused" if paused else "running"),
        actor,
        extra={
            "event": f"queue_{action}_set" if changed else f"queue_{action}_refused",
            "queue": queue,
            "actor": actor,
            "reason": reason,
        },
    )
    return changed
