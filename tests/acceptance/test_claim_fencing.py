"""Claims that cannot be stolen, with real processes: a frozen worker whose lease was taken
over, and a PostgreSQL outage under busy workers.

The zombie test freezes a worker with SIGSTOP in the middle of its attempt, lets the
reconciler repair the expired lease and a second worker finish the job, changes the ledger
so the frozen attempt's CSV would differ, then lets the zombie run on: it must lose every
write (``lease_lost``), and the object at the result key must stay the one the winner
committed. The outage test stops PostgreSQL for 40 s while two workers are busy: nothing may
be released towards the broker's delivery limit, quarantined or done twice.

The PostgreSQL the outage test stops is its own throwaway cluster (``own_pg``,
tests/own_servers.py), never the machine's: other tests, in parallel, keep theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import text

from jobrelay.domain.states import JobState
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import EventRecord, JobRecord, Store
from jobrelay.transport.topology import QUARANTINE_QUEUE, WORK_QUEUE

from ..conftest import OwnDatabase
from .procs import FAST_ENV, Proc, clean_env, free_port, poll, processes, run_cli, wait_http

pytestmark = [pytest.mark.slow]
T = TypeVar("T")

STALL_SECONDS = 10  # the zombie's first attempt: it is frozen long before it ends
# The outage outlasts the lease (so a held outcome must survive its lease running out), on a
# lease shortened from the default 30 s so the test does not wait out 40 s of nothing.
OUTAGE_LEASE_SECONDS = 5
OUTAGE_SECONDS = 12
OUTAGE_JOBS = 200
# A ledger row booked after the winner's export: in any CSV of this month written later.
LATE_ROW = "Booked after the takeover"


class Db:
    """Synchronous view of the job store (and raw SQL) for polling from a plain test."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = create_engine(url)
        self.store = Store(self.engine)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def job(self, job_id: str) -> JobRecord | None:
        return self.run(self.store.get_job(job_id))

    def events(self, job_id: str, kind: str) -> list[EventRecord]:
        return [e for e in self.run(self.store.events(job_id)) if e.kind == kind]

    def rows(self, sql: str, **params: Any) -> list[Any]:
        async def fetch() -> list[Any]:
            async with self.engine.connect() as conn:
                return list((await conn.execute(text(sql), params)).all())

        return self.run(fetch())

    def scalar(self, sql: str, **params: Any) -> Any:
        return self.rows(sql, **params)[0][0]

    def execute(self, sql: str, **params: Any) -> None:
        async def execute() -> None:
            async with self.engine.begin() as conn:
                await conn.execute(text(sql), params)

        self.run(execute())

    def reachable(self) -> bool:
        try:
            return bool(self.scalar("SELECT 1") == 1)
        except Exception:  # the server is still starting: refused, reset, "starting up"
            return False

    def blocks_writers(self, pid: int) -> bool:
        """Does process ``pid``, just frozen, hold a database transaction open?

        Frozen inside one, it would keep that transaction (and its locks) for as long as it
        is frozen. On PostgreSQL only ``pid``'s own sessions are looked at (matched by their
        client ports): whether other processes have a transaction open says nothing about the
        frozen one, and waiting on them under load once thawed and refroze the zombie until it
        had lost attempt 1 and taken (and lost) attempt 2 as well.
        """
        if self.engine.dialect.name == "sqlite":
            path = str(self.engine.url.database)
            conn = sqlite3.connect(path, timeout=3, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")  # takes the one write lock, or waits for it
                conn.execute("ROLLBACK")
                return False
            except sqlite3.OperationalError:  # still locked after 3 s: held by the frozen one
                return True
            finally:
                conn.close()
        ports = client_ports(pid)
        states = """
            SELECT state FROM pg_stat_activity
            WHERE datname = current_database() AND client_port = ANY(:ports)"""

        def settled() -> str | None:
            # A statement it sent before the stop runs to its end; then its session is idle,
            # or idle in a transaction it can no longer end.
            now = [row[0] for row in self.rows(states, ports=ports)]
            if any(state.startswith("idle in transaction") for state in now):
                return "open"
            return None if "active" in now else "clear"

        try:
            return poll(settled, 3, f"process {pid}'s sessions to settle") == "open"
        except AssertionError:  # a statement still running after 3 s: waiting on a lock
            return True

    def close(self) -> None:
        self.run(self.engine.dispose())
        self.loop.close()


@pytest.fixture(
    params=[
        pytest.param("embedded", id="sqlite-local"),
        pytest.param(
            "postgres", id="postgres-rabbitmq", marks=[pytest.mark.postgres, pytest.mark.rabbitmq]
        ),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """The database and broker settings: the embedded default, or PostgreSQL + RabbitMQ."""
    if request.param == "embedded":
        return {
            "JOBRELAY_DATABASE_URL": f"sqlite:///{tmp_path}/jobrelay.db",
            "JOBRELAY_BROKER_URL": "local",
        }
    return {
        # The processes run least-privileged (tests/conftest.py).
        "JOBRELAY_DATABASE_URL": str(request.getfixturevalue("pg_app_url")),
        "JOBRELAY_BROKER_URL": str(request.getfixturevalue("amqp_app_url")),
    }


def prepare(env: dict[str, str]) -> None:
    """Schema, broker topology and the sample ledgers, as an operator sets up a release."""
    for step in (("db", "upgrade"), ("broker", "declare"), ("seed", "--rows-per-month", "20")):
        result = run_cli(*step, env=env)
        assert result.returncode == 0, f"{' '.join(step)}: {result.stderr}"


@pytest.fixture
def db(backend: dict[str, str]) -> Iterator[Db]:
    db = Db(backend["JOBRELAY_DATABASE_URL"])
    yield db
    db.close()


def token(env: dict[str, str], account: str = "acme") -> str:
    result = run_cli("token", "create", "--account", account, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def results(root: Path) -> list[Path]:
    """Visible results; a writer's hidden temp file is not one."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def finished(db: Db, job_id: str, timeout: float = 60) -> JobRecord:
    def check() -> JobRecord | None:
        job = db.job(job_id)
        return job if job is not None and job.state.is_terminal else None

    return poll(check, timeout, f"job {job_id} to finish")


def pid_of(worker_id: object) -> int:
    """Worker ids are ``<host>:<pid>:<hex>``."""
    return int(str(worker_id).split(":")[-2])


def client_ports(pid: int) -> list[int]:
    """The local TCP ports of process ``pid``'s IPv4 sockets: its database sessions'
    ``client_port`` in ``pg_stat_activity``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # a descriptor closed while listed
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes:
            ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def is_stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def freeze(proc: Proc, db: Db) -> None:
    """SIGSTOP ``proc`` at a moment it holds no database transaction.

    A worker in its stall has none open, but its heartbeat and (local transport) its
    consumer write every fraction of a second. Frozen inside one of those, it would hold a
    PostgreSQL row lock or SQLite's single write lock, and the reconciler, the other worker
    and this test would wait for it. Then thaw it and try again.
    """
    for attempt in range(20):
        os.kill(proc.pid, signal.SIGSTOP)
        poll(lambda: is_stopped(proc.pid), 10, f"{proc.name} to be stopped")
        if not db.blocks_writers(proc.pid):
            return
        os.kill(proc.pid, signal.SIGCONT)
        poll(lambda: not is_stopped(proc.pid), 10, f"{proc.name} to run again")
        # Try again at another phase of its writes (CI, loaded: five tries in a row once
        # all landed inside one).
        time.sleep(0.01 * (attempt % 7))
    raise AssertionError(f"{proc.name} was inside a database transaction at every SIGSTOP")


def thaw(proc: Proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)


@pytest.mark.timeout(180)
@pytest.mark.long
def test_zombie_worker_loses_every_write_and_never_replaces_the_result(
    backend: dict[str, str], db: Db, tmp_path: Path
) -> None:
    exports = tmp_path / "exports"
    env = clean_env(
        **backend,
        JOBRELAY_RESULTS_URL=f"file://{exports}",
        **FAST_ENV,  # a 2 s lease among them
        JOBRELAY_RECONCILE_SECONDS="0.5",
        JOBRELAY_RECONCILE_GRACE_SECONDS="0.5",
    )
    prepare(env)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {token(env)}"}
    with processes(tmp_path) as start:
        api = start("api", "api", "--port", str(port), env=env)
        start("relay", "relay", env=env)
        # Prefetch 1: a frozen RabbitMQ consumer with room left would be pushed the
        # reconciler's repair message too, and sit on it while frozen.
        zombie = start(
            "worker",
            "worker",
            env={
                **env,
                "JOBRELAY_FAULTS": f"export.run:stall:{STALL_SECONDS}:1",
                "JOBRELAY_PREFETCH": "1",
            },
        )
        try:
            wait_http(base, api)
            accepted = httpx.post(
                f"{base}/v1/exports",
                json={"accountId": "acme", "period": "2020-05"},
                headers=auth,
                timeout=10,
            )
            assert accepted.status_code == 202, accepted.text
            job_id = accepted.json()["jobId"]
            poll(
                lambda: (
                    (j := db.job(job_id)) is not None
                    and j.state is JobState.RUNNING
                    and j.attempt == 1
                    and pid_of(j.lease_owner) == zombie.pid
                ),
                30,
                "the zombie-to-be to claim attempt 1",
            )
            freeze(zombie, db)
            repaired = poll(
                lambda: db.events(job_id, "reconciled_lease_expired"),
                30,
                "the reconciler to repair the expired lease",
            )
            assert repaired[0].detail["attempt"] == 1
            assert pid_of(repaired[0].detail["worker"]) == zombie.pid
            job = db.job(job_id)
            assert job is not None and job.state is JobState.RETRY_WAIT and job.attempt == 1

            winner = start("worker", "worker", env=env)
            job = finished(db, job_id)
            assert job.state is JobState.SUCCEEDED and job.attempt == 2
            assert job.result_key is not None and job.result_meta is not None
            saved = db.events(job_id, "result_saved")
            assert len(saved) == 1 and pid_of(saved[0].detail["worker"]) == winner.pid
            result = exports / job.result_key
            committed = result.stat()

            # From now on an export of this month has a 21st row, so the zombie's CSV, if
            # it were ever published, would differ from the winner's.
            db.execute(
                """INSERT INTO ledger_entries (account_id, booked_on, period, description,
                                               counterparty, amount, currency)
                   VALUES ('acme', '2020-05-15', '2020-05', :late, 'Zombie Ltd', 123.45, 'EUR')""",
                late=LATE_ROW,
            )
            assert (
                db.scalar(
                    "SELECT count(*) FROM ledger_entries WHERE account_id = 'acme'"
                    " AND period = '2020-05'"
                )
                == job.result_meta["rows"] + 1
            )

            thaw(zombie)
            lost = poll(
                lambda: db.events(job_id, "lease_lost"),
                30,
                "the zombie to record that it lost its lease",
            )
        finally:
            thaw(zombie)  # never leave a frozen process behind, whatever failed

        assert zombie.popen.poll() is None, zombie.log()[-3000:]  # it lost, it did not die
        served = httpx.get(f"{base}/v1/jobs/{job_id}/result", headers=auth, timeout=10)

    job = db.job(job_id)
    assert job is not None and job.state is JobState.SUCCEEDED and job.attempt == 2
    # The winner's attempt is its result_saved event's (never mixed into result_meta).
    assert [e.detail["attempt"] for e in db.events(job_id, "result_saved")] == [2]
    assert job.result_meta is not None and "attempt" not in job.result_meta
    # The object at the key is the one the winner committed, byte for byte, never replaced.
    assert results(exports) == [result]
    now = result.stat()
    assert (now.st_ino, now.st_mtime_ns) == (committed.st_ino, committed.st_mtime_ns)
    data = result.read_bytes()
    assert len(data) == job.result_meta["bytes"] == saved[0].detail["meta"]["bytes"]
    digest = hashlib.sha256(data).hexdigest()
    assert digest == job.result_meta["sha256"] == saved[0].detail["meta"]["sha256"]
    assert LATE_ROW.encode() not in data
    assert len(data.splitlines()) == 1 + job.result_meta["rows"]  # header + the winner's rows
    assert served.status_code == 200 and served.content == data
    # Whatever the zombie staged was discarded, not left behind.
    assert list(exports.rglob("*.tmp")) == []
    # The trail: two claims, one result, and the zombie's loss naming both tokens.
    assert len(db.events(job_id, "claimed")) == 2
    assert len(db.events(job_id, "result_saved")) == 1
    assert len(lost) == 1 and pid_of(lost[0].detail["worker"]) == zombie.pid
    assert lost[0].detail["attempt"] == 1 and lost[0].detail["currentAttempt"] == 2


def queue_counts(vhost: str, column: str = "messages") -> dict[str, int]:
    """One column of ``rabbitmqctl list_queues`` per queue (``messages``: ready + unacked)."""
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "-p", vhost, "--no-table-headers", "name", column],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return {name: int(n) for name, n in (line.split() for line in out.splitlines() if line.strip())}


@pytest.mark.postgres
@pytest.mark.rabbitmq
@pytest.mark.timeout(420)
@pytest.mark.long
def test_database_outage_holds_deliveries_and_finishes_every_job_once(
    own_pg: OwnDatabase, amqp_app_url: str, tmp_path: Path
) -> None:
    pg_url, pg_app_url, server = own_pg.url, own_pg.app_url, own_pg.server
    exports = tmp_path / "exports"
    vhost = urlsplit(amqp_app_url).path.lstrip("/")
    env = clean_env(
        JOBRELAY_DATABASE_URL=pg_app_url,
        JOBRELAY_BROKER_URL=amqp_app_url,
        JOBRELAY_RESULTS_URL=f"file://{exports}",
        JOBRELAY_MAX_ATTEMPTS="3",
        JOBRELAY_RETRY_DELAYS="1",
        JOBRELAY_RELAY_POLL_SECONDS="0.1",
        JOBRELAY_RELAY_CLAIM_SECONDS="3",
        JOBRELAY_RATE_LIMIT="off",  # 200 submits from one token, over the default burst
        JOBRELAY_LEASE_SECONDS=str(OUTAGE_LEASE_SECONDS),
    )
    assert OUTAGE_SECONDS > 2 * OUTAGE_LEASE_SECONDS
    prepare(env)
    db = Db(pg_url)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {token(env)}"}
    # Every export takes a moment, so some are always in flight when the server stops.
    worker_env = {**env, "JOBRELAY_FAULTS": "export.run:stall:0.2", "JOBRELAY_PREFETCH": "2"}
    try:
        with processes(tmp_path) as start:
            api = start("api", "api", "--port", str(port), env=env)
            relay = start("relay", "relay", env=env)
            wait_http(base, api)
            job_ids = []
            with httpx.Client(base_url=base, headers=auth, timeout=10) as client:
                for i in range(OUTAGE_JOBS):
                    body = {"accountId": "acme", "period": f"{2019 + i % 3}-{i % 12 + 1:02d}"}
                    answer = client.post(
                        "/v1/exports", json=body, headers={"Idempotency-Key": f"outage-{i}"}
                    )
                    assert answer.status_code == 202, answer.text
                    job_ids.append(answer.json()["jobId"])
            assert len(set(job_ids)) == OUTAGE_JOBS
            poll(
                lambda: db.scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0,
                60,
                "the relay to publish every job",
            )

            workers = [start("worker", "worker", env=worker_env) for _ in range(2)]
            succeeded = "SELECT count(*) FROM jobs WHERE state = 'succeeded'"
            poll(lambda: db.scalar(succeeded) >= 20, 120, "the first exports to succeed")
            done_before = db.scalar(succeeded)
            assert done_before < OUTAGE_JOBS - 50  # most of the work is still ahead

            server.stop()
            down_at = time.monotonic()
            try:
                poll(
                    lambda: all("consumer_paused" in w.events() for w in workers),
                    OUTAGE_SECONDS,
                    "both workers to notice the outage and pause",
                )
                time.sleep(max(0.0, down_at + OUTAGE_SECONDS - time.monotonic()))  # the outage
                assert all(w.popen.poll() is None for w in [*workers, relay])
                # Still held at the end: neither acked nor given back to the queue.
                held = queue_counts(vhost, "messages_unacknowledged")[WORK_QUEUE]
            finally:
                server.start()
            poll(db.reachable, 60, "PostgreSQL to accept connections again")

            poll(
                lambda: db.scalar(succeeded) == OUTAGE_JOBS,
                240,
                f"all {OUTAGE_JOBS} exports to succeed after the outage",
            )
            events = {event for w in workers for event in w.events()}
            assert all(p.popen.poll() is None for p in [*workers, relay])
            depths = queue_counts(vhost)

        states = dict(db.rows("SELECT state, count(*) FROM jobs GROUP BY state"))
        assert states == {"succeeded": OUTAGE_JOBS}
        kinds = dict(db.rows("SELECT kind, count(*) FROM job_events GROUP BY kind"))
        assert "quarantined" not in kinds and "rejected" not in kinds, kinds
        saves = "SELECT job_id, count(*) FROM job_events WHERE kind = 'result_saved' GROUP BY 1"
        saved = dict(db.rows(saves))
        assert saved == dict.fromkeys(job_ids, 1)
        assert depths[QUARANTINE_QUEUE] == 0  # nothing dead-lettered by the delivery limit
        # The outage hit work in flight, and the workers held it instead of giving it back.
        assert "outcome_held" in events or "delivery_held" in events
        assert held > 0
        assert "consumer_resumed" in events
        assert "delivery_error" not in events
        # Every visible object is the one its job committed.
        assert len(results(exports)) == OUTAGE_JOBS
        for job_id in job_ids:
            job = db.job(job_id)
            assert job is not None and job.result_key is not None and job.result_meta is not None
            data = (exports / job.result_key).read_bytes()
            stored = (len(data), hashlib.sha256(data).hexdigest())
            assert stored == (job.result_meta["bytes"], job.result_meta["sha256"]), job_id
    finally:
        db.close()
