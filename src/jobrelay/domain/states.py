"""Job states and the only transitions allowed between them.

The table is enforced twice: here, so the policy can never propose an illegal move, and in
SQL, where every state change is a guarded ``UPDATE … WHERE state IN (:expected)`` so two
processes racing on one job cannot both win.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    # Written with ``after=``: no message, no worker; made ``queued`` in the transaction that
    # commits the last of its dependencies' outcomes (``storage.dependencies``).
    WAITING = "waiting"
    QUEUED = "queued"
    RUNNING = "running"
    RETRY_WAIT = "retry_wait"
    SUCCEEDED = "succeeded"
    QUARANTINED = "quarantined"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """Terminal for the pipeline: no delivery may move it (operators still can)."""
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.QUARANTINED, JobState.CANCELLED})
# The states a job has not ended in, as the column stores them (SQL ``IN`` lists), in order.
UNFINISHED_VALUES = tuple(s.value for s in JobState if s not in TERMINAL_STATES)

# (from, to) -> who may make that move. "pipeline" moves happen on a delivery; "operator"
# moves only through an audited operator action.
TRANSITIONS: dict[tuple[JobState, JobState], str] = {
    # The last of its dependencies ended (``storage.dependencies``); one that failed cancels
    # it there too, unless it was written with ``after_failure="run"``.
    (JobState.WAITING, JobState.QUEUED): "pipeline",
    (JobState.QUEUED, JobState.RUNNING): "pipeline",
    (JobState.RETRY_WAIT, JobState.RUNNING): "pipeline",
    # A lease that expired while running (the worker died) is taken over by a new claim.
    (JobState.RUNNING, JobState.RUNNING): "pipeline",
    (JobState.RUNNING, JobState.SUCCEEDED): "pipeline",
    (JobState.RUNNING, JobState.RETRY_WAIT): "pipeline",
    (JobState.RUNNING, JobState.QUARANTINED): "pipeline",
    # A bad payload or an exhausted budget is found before the job is claimed.
    (JobState.QUEUED, JobState.QUARANTINED): "pipeline",
    (JobState.RETRY_WAIT, JobState.QUARANTINED): "pipeline",
    # An operator's cancel of a running job is a request (``storage.cancels``): the job is
    # ended by its worker (fenced on the claim) or, its lease expired, by the reconciler.
    (JobState.RUNNING, JobState.CANCELLED): "pipeline",
    (JobState.QUEUED, JobState.CANCELLED): "operator",
    (JobState.WAITING, JobState.CANCELLED): "operator",
    (JobState.RETRY_WAIT, JobState.CANCELLED): "operator",
    (JobState.QUARANTINED, JobState.CANCELLED): "operator",
    (JobState.QUARANTINED, JobState.QUEUED): "operator",
}


def can_transition(source: JobState, target: JobState, *, by: str = "pipeline") -> bool:
    """True when ``source -> target`` is a legal move for ``by`` ("pipeline" or "operator")."""
    return TRANSITIONS.get((source, target)) == by


def sources_for(target: JobState, *, by: str = "pipeline") -> frozenset[JobState]:
    """Every state from which ``by`` may move a job to ``target``: the SQL guard's IN-list."""
    return frozenset(s for (s, t), who in TRANSITIONS.items() if t == target and who == by)
