"""No index of ``jobs`` holds a column that a transition between unfinished states writes.

PostgreSQL updates a row in place (HOT: no new entry in any index) only when no indexed
column changed, the columns of a partial index's condition included. With ``state`` and
``updated_at`` indexed (``ix_jobs_state_updated``, and ``ix_jobs_account_unfinished`` partial
on ``state``), none of a job's updates was HOT: 0 of 44,256 in the no-op drain (issue 41).
"""

from __future__ import annotations

import re

import pytest
from sqlalchemy import literal_column

from jobrelay.storage import transitions
from jobrelay.storage.tables import jobs
from jobrelay.storage.transitions import Inputs, Transition

_NAMES = {c.name for c in jobs.columns}


def _indexed_columns() -> dict[str, set[str]]:
    """Each index of ``jobs``: its columns and those its condition reads."""
    out: dict[str, set[str]] = {}
    for index in jobs.indexes:
        cols = {c.name for c in index.columns}
        where = index.dialect_options["postgresql"].get("where")
        if where is not None:
            cols |= set(re.findall(r"[a-z_]+", str(where))) & _NAMES
        out[str(index.name)] = cols
    return out


def _written(t: Transition) -> dict[str, object]:
    i = Inputs(
        now=literal_column("now"),
        clock=literal_column("clock"),
        due_by=literal_column("due"),
        lease_ends=literal_column("lease"),
    )
    return dict(t.sets(i))


_UNFINISHED_MOVES = {
    name: t
    for name, t in vars(transitions).items()
    if isinstance(t, Transition)
    and (t.target is None or not t.target.is_terminal)
    and name != "REPLAY"  # re-opens a finished job: it leaves the finished jobs' index
}


def test_the_transitions_between_unfinished_states_are_known() -> None:
    assert {"CLAIM", "RENEW", "PROGRESS", "RETRY", "LEASE_EXPIRED"} <= set(_UNFINISHED_MOVES)


@pytest.mark.parametrize("name", sorted(_UNFINISHED_MOVES))
def test_a_transition_between_unfinished_states_writes_no_indexed_column(name: str) -> None:
    written = _written(_UNFINISHED_MOVES[name])
    # A column written NULL changes nothing where it is NULL already (PostgreSQL compares the
    # values): ``finished_at`` on an unfinished job, and a release's ``admitted_at`` and
    # ``throttled_at`` on a job under no limits (one under limits leaves ``ix_jobs_held``
    # then, and its index entry is the point).
    nulls = {c for c, v in written.items() if str(v) == "NULL"}
    for index, cols in _indexed_columns().items():
        changed = cols & set(written) - nulls
        assert not changed, f"{name} writes {sorted(changed)}, which {index} holds"


def test_finished_at_is_stamped_by_the_end_and_cleared_by_the_replay() -> None:
    now = literal_column("now")
    i = Inputs(now=now, clock=now, lease_ends=now)
    for t in (transitions.COMPLETE, transitions.QUARANTINE, transitions.CANCEL):
        assert t.sets(i)["finished_at"] is now
    assert str(transitions.REPLAY.sets(i)["finished_at"]) == "NULL"
