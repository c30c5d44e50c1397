"""``jobrelay quarantine purge`` on SQLite + local transport and PostgreSQL + RabbitMQ.

A quarantined job that an operator replayed leaves its rejected copy in the quarantine queue,
and the reconciler reports it (``quarantine_mismatch``, and its gauge) until it is gone. The
purge removes exactly that copy; a copy of a job still quarantined, and a message naming no
job, stay. After it, the reconciler's finding and gauge are back to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path
from typing import Any

import pytest

from jobrelay.admin.quarantine_purge import purge_quarantine
from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState
from jobrelay.library.operator import Operator
from jobrelay.maintenance.reconcile import QUARANTINE_MISMATCH, Reconciler
from jobrelay.transport.base import OutgoingMessage

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(120)
S = JobState


async def dead_letter(transport: Any, job_id: str) -> None:
    """A copy of ``job_id``'s message, rejected by a consumer: the broker dead-letters it."""
    await transport.publish(
        OutgoingMessage(
            "work",
            JobMessage(job_id, "report.export").encode(),
            headers={"x-jobrelay-job-id": job_id},
        )
    )
    deliveries = transport.consume(1)
    try:
        delivery = await asyncio.wait_for(anext(deliveries), 20)
        await delivery.reject()
    finally:
        with contextlib.suppress(Exception):
            await deliveries.aclose()


def mismatch_gauge(p: Any) -> float:
    value = p.rt.metrics.reconcile_findings.labels(finding=QUARANTINE_MISMATCH)._value.get()
    return float(value)


async def test_purge_removes_only_the_stale_copies_and_the_finding_clears(
    make_pipeline: Any,
) -> None:
    async with make_pipeline(faults="export.run:invalid@period=2020-01") as p:
        replayed = await p.submit(period="2020-01")
        p.start_relay()
        await p.start_worker()
        await p.wait_for(replayed, lambda j: j.state is S.QUARANTINED)
        await p.stop_all()
        outcome = await Operator(p.rt).replay(replayed, actor="t", reason="fixed")
        assert outcome.done
        still = await p.submit(period="2020-02")
        await dead_letter(p.rt.transport, still)
        assert await p.store.quarantine(still, "bad payload", p.rt.clock())
        nobody = str(uuid.uuid4())
        await dead_letter(p.rt.transport, nobody)

        async def three() -> bool:
            return await p.rt.transport.quarantine_depth() == 3

        await eventually(three, what="three messages in the quarantine queue")
        before = await Reconciler(p.rt).run_once()
        found = [f for f in before.findings if f.kind == QUARANTINE_MISMATCH]
        assert [f.job_id for f in found] == [replayed]
        assert "jobrelay quarantine purge" in found[0].detail
        assert mismatch_gauge(p) == 1
        await eventually(three, what="the scan to give every message back")

        dry = await purge_quarantine(p.rt, limit=100, dry_run=True)
        assert [(r.job_id, r.state) for r in dry.removed] == [(replayed, "queued")]
        await eventually(three, what="a dry run to give every message back")

        done = await purge_quarantine(p.rt, limit=100)
        assert [(r.job_id, r.state) for r in done.removed] == [(replayed, "queued")]
        assert (done.scanned, done.kept_quarantined, done.kept_unknown) == (3, 1, 1)

        async def two() -> bool:
            return await p.rt.transport.quarantine_depth() == 2

        await eventually(two, what="the stale copy to be gone")
        after = await Reconciler(p.rt).run_once()
        assert after.quarantine_scanned == 2
        assert [f for f in after.findings if f.kind == QUARANTINE_MISMATCH] == []
        assert mismatch_gauge(p) == 0
        assert (await p.store.get_job(replayed)).state is S.QUEUED  # the job is untouched
        assert (await p.store.get_job(still)).state is S.QUARANTINED


def test_the_cli_lists_what_it_would_remove_and_says_what_it_kept(tmp_path: Path) -> None:
    from tests.acceptance.procs import clean_env, run_cli

    env = clean_env(JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/jr.db")
    assert run_cli("db", "upgrade", env=env).returncode == 0
    result = run_cli("quarantine", "purge", "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "quarantine purge (dry run): 0 message(s) read, 0 would remove, "
        "0 kept (job quarantined), 0 kept (no known job)"
    )
    bad = run_cli("quarantine", "purge", "--limit", "0", env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
