"""Model-based test: random interleavings of submits, deliveries, duplicates, crashes and time.

Hypothesis drives the real store (SQLite) and the real worker's ``handle`` with in-test
deliveries, a clock it controls and crash faults at the worker's named points. After every
step it checks the invariants the product promises:

- no accepted job is lost: each one is finished, or has a message still to be delivered;
- at most one ``result_saved`` per job, and a finished job never changes state;
- every state change seen is an edge of the state machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jobrelay.domain.ids import job_id_for, request_hash
from jobrelay.domain.states import JobState, can_transition
from jobrelay.faults import Faults
from jobrelay.results.files import FileResults
from jobrelay.runtime import Runtime, topology_for
from jobrelay.seed import seed
from jobrelay.settings import Settings
from jobrelay.storage.engine import create_engine, upgrade
from jobrelay.storage.store import NewJob, Store
from jobrelay.transport.topology import retry_seconds
from jobrelay.worker import Worker

PERIODS = ("2020-01", "2020-02", "2020-03")
CRASH_POINTS = (None, "export.run", "worker.before_ack")


class Crash(BaseException):
    pass


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


class Delivery:
    """A broker delivery the model settles by hand; an unsettled one is redelivered."""

    def __init__(self, body: bytes, redelivered: bool) -> None:
        self.body = body
        self.headers: dict[str, object] = {}
        self.redelivered = redelivered
        self.delivery_count = int(redelivered)
        self.outcome: str | None = None

    async def ack(self) -> None:
        self.outcome = "ack"

    async def reject(self) -> None:
        self.outcome = "reject"

    async def release(self) -> None:
        self.outcome = "release"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


class PipelineModel(RuleBasedStateMachine):
    template: Path

    @initialize()
    def boot(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="jobrelay-model-"))
        shutil.copy(self.template, self.dir / "db.sqlite")
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        self.settings = Settings(
            database_url=f"sqlite:///{self.dir}/db.sqlite",
            results_url=f"file://{self.dir}/exports",
            retry_delays="5",
            lease_seconds=30,
            max_attempts=3,
        )
        self.engine = create_engine(self.settings.database_url)
        self.store = Store(self.engine)
        self.rt = Runtime(
            settings=self.settings,
            engine=self.engine,
            store=self.store,
            transport=None,  # type: ignore[arg-type]  # handle() never touches it
            results=FileResults(self.settings.results_url),
            faults=Faults(),
            topology=topology_for(self.settings),
            clock=self.clock,
        )
        self.run(seed(self.store, 5))
        self.accepted: set[str] = set()
        # Published, not yet settled: (body, when the broker makes it deliverable).
        self.in_flight: list[tuple[bytes, datetime]] = []
        self.seen: dict[str, JobState] = {}
        self.worker_n = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        if hasattr(self, "loop"):
            self.run(self.engine.dispose())
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- rules ---------------------------------------------------------------------------

    @rule(period=st.sampled_from(PERIODS), duplicate=st.booleans())
    def submit(self, period: str, duplicate: bool) -> None:
        params = {"accountId": "acme", "period": period}
        job = NewJob(
            job_id_for("acme", "report.export", params),
            "report.export",
            "acme",
            params,
            request_hash("acme", "report.export", params),
            max_attempts=3,
        )
        for _ in range(2 if duplicate else 1):
            job_id, _ = self.run(self.store.submit(job, self.clock()))
        self.accepted.add(job_id)

    @rule()
    def relay(self) -> None:
        now = self.clock()
        rows = self.run(self.store.claim_outbox("relay", now, 50, timedelta(seconds=30)))
        for row in rows:
            delay = retry_seconds(row.destination) or 0
            self.in_flight.append((row.body, now + timedelta(seconds=delay)))
        self.run(self.store.mark_published("relay", rows, now))

    def _deliverable(self) -> list[tuple[bytes, datetime]]:
        return [m for m in self.in_flight if m[1] <= self.clock()]

    @precondition(lambda self: bool(self._deliverable()))
    @rule(
        pick=st.integers(min_value=0, max_value=50),
        crash=st.sampled_from(CRASH_POINTS),
        duplicate=st.booleans(),
    )
    def deliver(self, pick: int, crash: str | None, duplicate: bool) -> None:
        ready = self._deliverable()
        message = ready[pick % len(ready)]
        self.worker_n += 1
        self.rt.faults = Faults(f"{crash}:crash", crash_handler=_crash) if crash else Faults()
        delivery = Delivery(message[0], redelivered=duplicate)
        # A Crash is the process dying unsettled: the broker delivers the message again.
        with contextlib.suppress(Crash):
            self.run(Worker(self.rt, worker_id=f"w{self.worker_n}").handle(delivery))
        if delivery.outcome in ("ack", "reject") and not duplicate:
            self.in_flight.remove(message)
        # With duplicate=True this was a second copy (a relay republish): the original stays.

    @rule(seconds=st.sampled_from([1, 5, 31, 120]))
    def advance(self, seconds: int) -> None:
        self.clock.now += timedelta(seconds=seconds)

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def finished_jobs_stay_finished_and_moves_are_legal(self) -> None:
        if not hasattr(self, "store"):
            return
        for job in self.run(self.store.list_jobs(limit=1000)):
            before = self.seen.get(job.id)
            if before is not None and before is not job.state:
                assert not before.is_terminal, f"{job.id}: {before} -> {job.state}"
                assert _reachable(before, job.state), f"{before} -> {job.state}"
            self.seen[job.id] = job.state

    @invariant()
    def at_most_one_result(self) -> None:
        if not hasattr(self, "store"):
            return
        for job_id in self.accepted:
            kinds = [e.kind for e in self.run(self.store.events(job_id))]
            assert kinds.count("result_saved") <= 1

    @invariant()
    def no_accepted_job_is_lost(self) -> None:
        if not hasattr(self, "store"):
            return
        pending = {b.decode() for b, _ in self.in_flight}
        for job_id in self.accepted:
            job = self.run(self.store.get_job(job_id))
            assert job is not None, "accepted job vanished"
            if job.state.is_terminal:
                continue
            has_message = job.unpublished_since is not None or any(
                job_id in body for body in pending
            )
            assert has_message, f"{job_id} is {job.state} with no message left to deliver it"


def _reachable(source: JobState, target: JobState) -> bool:
    """One step of the model may make several pipeline moves (queued -> running -> done)."""
    seen, frontier = {source}, [source]
    while frontier:
        state = frontier.pop()
        for nxt in JobState:
            if nxt not in seen and can_transition(state, nxt):
                seen.add(nxt)
                frontier.append(nxt)
    return target in seen


def _crash(point: str) -> NoReturn:
    raise Crash(point)


@pytest.mark.timeout(600)
def test_pipeline_model(template: Path) -> None:
    PipelineModel.template = template
    run = PipelineModel.TestCase
    run.settings = settings(
        max_examples=25,
        stateful_step_count=20,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    run().runTest()
