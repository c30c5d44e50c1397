"""A delayed job read by a person: ``job show``, ``jobs list``'s wording and the explanation
say it waits for its run time on purpose (not "is a relay running?"), and when it runs."""

from __future__ import annotations

from datetime import timedelta

import pytest

from jobrelay.admin.account_view import account_next_step
from jobrelay.admin.explain import explain_document, next_step, render_job
from jobrelay.domain.states import JobState as S
from jobrelay.storage.store import JobRecord

from .records import NOW
from .records import job_record as job

RUN_AT = NOW + timedelta(seconds=90)


def delayed(**changes: object) -> JobRecord:
    return job(published=False, unpublished_since=RUN_AT, run_at=RUN_AT, **changes)


def test_a_job_waiting_for_its_run_time_is_delayed_not_stuck() -> None:
    record = delayed()
    step = next_step(record, NOW)
    assert step.startswith(f"delayed, not stuck: runs at {RUN_AT.isoformat()} (in 90 s)")
    assert "is a relay running?" not in step
    scheduled = f"scheduled: runs at {RUN_AT.isoformat()} (in 90 s)"
    assert account_next_step(record, NOW) == scheduled
    document = explain_document(record, [], NOW)
    assert document["runAt"] == RUN_AT.isoformat()


def test_once_due_and_still_unpublished_it_is_the_relays_problem_again() -> None:
    record = job(published=False, unpublished_since=RUN_AT, run_at=RUN_AT)
    later = RUN_AT + timedelta(seconds=30)
    assert "is a relay running?" in next_step(record, later)
    assert not record.waiting_for_run_at(later)
    assert not job(state=S.CANCELLED, run_at=RUN_AT).waiting_for_run_at(NOW)


def test_job_show_prints_runs_at_and_how_long(capsys: pytest.CaptureFixture[str]) -> None:
    render_job(delayed(), [], NOW)
    out = capsys.readouterr().out
    assert f"runs at {RUN_AT.isoformat()} (in 90 s)" in out
    assert "not yet: held until its run time" in out
    # After it ran, the run time stays as history.
    render_job(job(state=S.SUCCEEDED, result_key="k", run_at=RUN_AT), [], RUN_AT + timedelta(1))
    out = capsys.readouterr().out
    assert "run at" in out and "(in " not in out
