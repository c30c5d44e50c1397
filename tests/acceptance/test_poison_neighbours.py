"""A job that kills its worker costs its neighbours nothing, with real processes.

A poison job (``export.run:crash``, ``os._exit`` like ``kill -9``) is claimed beside healthy
jobs that are still running when it kills the worker: they lose that attempt with it (the
one charge nobody can refund: the worker died under them). From then on each of them is a
suspect (its last attempt ended with the worker lost) and is claimed alone in its worker,
so only the poison job dies again, attempt after attempt, until it is quarantined. Every
worker death also returns the messages the worker held but had not started; the broker
counts each return towards its delivery limit, which must stay far above what such deaths
add up to, so none of them is dead-lettered (the jobs would then never finish).

Both backends: SQLite + the local transport, PostgreSQL + RabbitMQ.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobrelay.domain.ids import request_hash
from jobrelay.domain.states import JobState
from jobrelay.runtime.wiring import utc_now
from jobrelay.storage.store import NewJob
from tests.id_keys import request_id

from .procs import FAST_ENV, clean_env, poll, processes, supervise_workers
from .test_claim_fencing import Db, backend, db, prepare

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
__all__ = ["backend", "db"]  # the fixtures, shared with the fencing tests

POISON_PERIOD = "2020-02"
# Deaths: one per attempt of the poison job. More than the old delivery limit (5), so a
# message held unstarted through every death would have been dead-lettered.
POISON_ATTEMPTS = 6
HEALTHY = 24


def _submit(db: Db, period: str, max_attempts: int) -> str:
    params = {"accountId": "acme", "period": period}
    job = NewJob(
        db.run(request_id(db.store, "acme", params)),
        "report.export",
        "acme",
        params,
        request_hash("acme", "report.export", params),
        max_attempts=max_attempts,
    )
    job_id, created = db.run(db.store.submit(job, utc_now()))
    assert created
    return job_id


def test_a_crash_looping_job_takes_no_healthy_neighbour_with_it(
    backend: dict[str, str], db: Db, tmp_path: Path
) -> None:
    env = clean_env(**backend, JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports", **FAST_ENV)
    prepare(env)
    # The poison job crashes at once; every other job stays busy for a while, so the ones
    # claimed around it are surely running when it kills the worker. Eight slots, and the
    # default broker window: most of what a worker holds waits unstarted.
    worker_env = {
        **env,
        "JOBRELAY_FAULTS": f"export.run:crash@period={POISON_PERIOD},export.run:stall:1",
        "JOBRELAY_CONCURRENCY": "8",
    }
    poison = _submit(db, POISON_PERIOD, POISON_ATTEMPTS)
    healthy = [
        _submit(db, f"{2021 + i // 12}-{i % 12 + 1:02d}", max_attempts=3) for i in range(HEALTHY)
    ]
    with processes(tmp_path) as start:
        start("relay", "relay", env=env)
        # Every message is in the queue before a worker takes any: the poison job first.
        poll(
            lambda: db.scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0,
            60,
            "every message published",
        )
        workers = [start("worker", "worker", env=worker_env) for _ in range(2)]

        def settled() -> bool:
            jobs = [db.job(j) for j in [poison, *healthy]]
            return all(j is not None and j.state.is_terminal for j in jobs)

        # A dead-lettered message would leave its job queued: this would time out.
        deaths = supervise_workers(
            start, workers, worker_env, settled, 240,
            "the poison job quarantined and every healthy job finished",
        )  # fmt: skip
    job = db.job(poison)
    assert job is not None and job.state is JobState.QUARANTINED
    assert job.attempt == POISON_ATTEMPTS
    assert "attempts exhausted" in (job.quarantine_reason or ""), job.quarantine_reason
    assert deaths == POISON_ATTEMPTS  # only the poison job's own attempts killed a worker
    for job_id in healthy:
        done = db.job(job_id)
        assert done is not None and done.state is JobState.SUCCEEDED, (
            job_id,
            done and done.state,
            done and done.quarantine_reason,
        )
        # At most the one death it was claimed beside, never one of the poison's later ones.
        assert done.attempt <= 2, (job_id, done.attempt)
