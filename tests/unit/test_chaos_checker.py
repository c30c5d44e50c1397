"""The soak's plan and checker, as pure functions: a checker that cannot see a lost job, a
second e-mail or a wrongly quarantined job would make every green soak meaningless, so each
violation is shown here being caught, on facts built by hand."""

from __future__ import annotations

import dataclasses
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from jobrelay.chaos.clients import Record, Request
from jobrelay.chaos.plan import FAULT_POINTS, PROFILES, Plan, make_plan
from jobrelay.chaos.verdict import (
    EXPORT,
    NOTIFY,
    Mail,
    World,
    expected_job_id,
    judge,
    summary_line,
)
from jobrelay.domain.ids import follow_up_job_id
from jobrelay.domain.states import JobState as S
from jobrelay.storage.audit import Facts, RunEvent
from jobrelay.storage.store import JobRecord

from .records import job_record

WORKERS, RELAYS = ("worker-1", "worker-2"), ("relay-1", "relay-2")
SECRET = bytes(range(32))  # the installation's id secret in these worlds


def plan(jobs: int = 4, poison: int = 1, seed: int = 5) -> Plan:
    return make_plan(seed, jobs, poison, PROFILES["short"], WORKERS, RELAYS)


def test_the_same_seed_gives_the_same_plan_and_another_seed_another() -> None:
    assert make_plan(9, 50, 3, PROFILES["full"], WORKERS, RELAYS) == make_plan(
        9, 50, 3, PROFILES["full"], WORKERS, RELAYS
    )
    assert plan(seed=1).faults != plan(seed=2).faults


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_fault_point_crashes_early_and_both_services_restart(profile: str) -> None:
    for seed in range(20):
        p = make_plan(seed, 100, 3, PROFILES[profile], WORKERS, RELAYS)
        crashes = [i for i, f in enumerate(p.faults) if f.kind == "crash"]
        points = {p.faults[i].point for i in crashes}
        assert points == {f"{point}:crash:1" for point in FAULT_POINTS}
        assert max(crashes) < max(len(crashes), int(len(p.faults) * 0.6))
        assert not (p.faults[0].point or "").startswith("notify")
        kinds = Counter(f.kind for f in p.faults)
        assert kinds["rabbitmq_restart"] == kinds["postgres_restart"] == 1
        assert sum(1 for s in p.submissions if s.poison) == 3
        assert len({s.key for s in p.submissions}) == 100


def test_a_failover_held_at_the_api_comes_while_submissions_last() -> None:
    """CI (a slower machine): a failover held at ``api.before_response`` was placed late in
    the plan, came after the last submission, and never fired (``faults_missed``). The
    faults at that point (its crash too) come right after the first now; the old code
    placed them anywhere in the first 60 % (the crash) or the whole plan (the failover)."""
    for seed in range(40):
        p = make_plan(seed, 200, 3, PROFILES["short"], WORKERS, RELAYS, failovers=5)
        held = [i for i, f in enumerate(p.faults) if (f.point or "").startswith("api.before")]
        failover = [i for i in held if p.faults[i].kind == "postgres_failover"]
        assert len(failover) == 1
        assert max(held) <= 2, (seed, held)  # right after the first fault


class World_:
    """A consistent, all-good world for a plan, to be spoiled one fact at a time."""

    def __init__(self, p: Plan) -> None:
        self.plan = p
        self.records: list[Record] = []
        self.jobs: dict[str, JobRecord] = {}
        self.events: dict[str, Counter[str]] = {}
        self.effects: dict[str, tuple[str, str]] = {}
        self.keys: list[str] = []
        self.mails: list[Mail] = []
        self.runs: list[RunEvent] = []  # claims and run ends, in the order written
        self.slots_held = 0
        self.id_secret = SECRET
        for s in p.submissions:
            record = Record(s)
            job_id = expected_job_id(record, SECRET)
            record.requests.append(Request(0.0, "ok", 202, job_id))
            record.job_id = job_id
            self.records.append(record)
            if s.poison:
                self.jobs[job_id] = fact(job_id, EXPORT, S.QUARANTINED)
                continue
            self.jobs[job_id] = fact(
                job_id, EXPORT, S.SUCCEEDED, accountId=s.account, notifyEmail=s.email
            )
            self.events[job_id] = Counter(result_saved=1)
            self.keys.append(f"jobrelay/exports/{s.account}/{job_id}.csv")
            notify = follow_up_job_id(job_id, NOTIFY)
            self.jobs[notify] = fact(notify, NOTIFY, S.SUCCEEDED)
            self.effects[notify] = ("sent", f"<export-{job_id}@example.com>")
            self.mails.append(Mail(f"<export-{job_id}@example.com>", (s.email,)))

    def judge(
        self,
        unpublished: int = 0,
        depths: dict[str, int] | None = None,
        missed: tuple[str, ...] = (),
        dead_lettering: dict[str, int] | None = None,
        limit: int | None = None,
    ) -> dict[str, int]:
        facts = Facts(
            self.jobs,
            self.events,
            self.effects,
            unpublished,
            self.id_secret,
            tuple(self.runs),
            self.slots_held,
        )
        seen = World(
            object_keys=tuple(self.keys),
            open_uploads=0,
            mails=tuple(self.mails),
            queue_depths=depths or {"jobrelay.work": 0},
            dead_letters=(),
            faults_missed=missed,
            dead_lettering=dead_lettering or {},
        )
        verdict = judge(self.records, facts, seen, limit)
        self.verdict = verdict
        return {k: v for k, v in verdict.violations.items() if v}


CREATED = datetime(2026, 1, 1, 12, 0, 10, tzinfo=UTC)


def fact(job_id: str, job_type: str, state: S, **params: str) -> JobRecord:
    return job_record(
        id=job_id, type=job_type, state=state, attempt=1, params=dict(params), created_at=CREATED
    )


def healthy(w: World_) -> str:
    return next(r.job_id for r in w.records if r.job_id and not r.submission.poison)


def test_an_all_good_world_passes_and_says_so_on_the_last_line() -> None:
    w = World_(plan())
    assert w.judge() == {}
    line = summary_line(5, w.verdict, 12.0, 9)
    assert line.startswith("chaos: accepted=4 lost=0 stuck=0 dup_results=0 dup_emails=0 ")
    assert line.endswith(" OK") and "quarantined=1/1" in line


def test_the_checker_recomputes_ids_with_the_installations_secret() -> None:
    # Ids keyed with another secret than the database's: no accepted job is found where
    # the checker looks, so a checker that ignored the secret could not pass this world.
    w = World_(plan())
    w.id_secret = bytes(range(1, 33))
    violations = w.judge()
    assert violations["id_mismatch"] == 4 and violations["lost"] == 4, violations


def test_an_accepted_job_that_is_missing_or_unfinished_is_lost() -> None:
    w = World_(plan())
    job_id = healthy(w)
    w.jobs[job_id] = fact(job_id, EXPORT, S.RUNNING, notifyEmail="x@example.com")
    assert w.judge() == {"lost": 1, "stuck": 1}
    assert w.verdict.counts["orphan_results"] == 1  # its attempt's object: never served
    del w.jobs[job_id]
    assert w.judge()["lost"] == 1


def test_a_finished_export_whose_email_job_is_missing_is_lost() -> None:
    w = World_(plan())
    del w.jobs[follow_up_job_id(healthy(w), NOTIFY)]
    assert w.judge() == {"lost": 1}


def test_second_result_write_or_object_is_a_duplicate() -> None:
    w = World_(plan())
    w.events[healthy(w)]["result_saved"] = 2
    assert w.judge() == {"dup_results": 1}
    w.events[healthy(w)]["result_saved"] = 1
    w.keys.append(w.keys[0].replace("jobrelay/", "other/"))
    assert w.judge() == {"dup_results": 1}


def test_an_attempts_upload_its_job_does_not_name_is_an_orphan_not_a_duplicate() -> None:
    """S3 results are uploaded under their attempt's own key before the completion names
    one (issue 34): an attempt that died between its upload and its completion leaves an
    object no job names, never served. A second object the job's key names is a duplicate."""
    w = World_(plan())
    job_id = healthy(w)
    account = next(r.submission.account for r in w.records if r.job_id == job_id)
    w.jobs[job_id] = dataclasses.replace(
        w.jobs[job_id], result_key=f"exports/{account}/{job_id}.attempt-2.csv"
    )
    w.keys = [k for k in w.keys if job_id not in k]
    w.keys.append(f"jobrelay/exports/{account}/{job_id}.attempt-2.csv")
    assert w.judge() == {}
    w.keys.append(f"jobrelay/exports/{account}/{job_id}.attempt-1.csv")
    assert w.judge() == {}
    assert w.verdict.counts["orphan_results"] == 1
    w.keys.append(f"other/exports/{account}/{job_id}.attempt-2.csv")
    assert w.judge() == {"dup_results": 1}


def test_second_email_is_a_duplicate_unless_the_ledger_flagged_the_window() -> None:
    w = World_(plan())
    w.mails.append(w.mails[0])
    assert w.judge() == {"dup_emails": 1}
    notify = next(j for j, (_, mid) in w.effects.items() if mid == w.mails[0].message_id)
    w.effects[notify] = ("possible_duplicate", w.mails[0].message_id)
    assert w.judge() == {}
    assert w.verdict.counts["window_dup_emails"] == 1


def test_a_missing_email_or_result_and_an_object_of_no_job_are_caught() -> None:
    w = World_(plan())
    w.mails.pop()
    w.keys.pop()
    assert w.judge() == {"missing_emails": 1, "missing_results": 1}
    w.keys.append("jobrelay/exports/acme/00000000-0000-0000-0000-000000000000.csv")
    assert w.judge()["stray_results"] == 1


def test_quarantined_must_be_exactly_the_poison_jobs() -> None:
    w = World_(plan())
    job_id = healthy(w)
    w.jobs[job_id] = fact(job_id, EXPORT, S.QUARANTINED)
    del w.jobs[follow_up_job_id(job_id, NOTIFY)]
    w.keys = [k for k in w.keys if job_id not in k]
    assert w.judge() == {"wrongly_quarantined": 1}
    poison = next(r.job_id for r in w.records if r.submission.poison)
    assert poison is not None
    w.jobs[poison] = fact(poison, EXPORT, S.CANCELLED)
    assert w.judge()["poison_not_quarantined"] == 1


def test_unknown_requests_are_resolved_by_when_the_job_was_created() -> None:
    w = World_(plan())
    created = CREATED.timestamp()
    first, second = w.records[0], w.records[1]
    # The first request committed (the row appeared while it was in flight), then the answer
    # was lost; the retry found it. The second submission saw a 503 before its job existed.
    first.requests.insert(0, Request(0.0, "unknown", None, "RemoteProtocolError",
                                     created - 0.2, created + 0.1))  # fmt: skip
    first.requests.insert(1, Request(0.0, "unknown", 503, "starting",
                                     created + 1, created + 1.1))  # fmt: skip
    second.requests.insert(0, Request(0.0, "unknown", 503, "database unavailable",
                                      created - 3, created - 2.5))  # fmt: skip
    assert w.judge() == {}
    counts = w.verdict.counts
    assert counts["requests_unknown"] == 3
    assert (counts["unknown_resolved_created"], counts["unknown_resolved_existed"]) == (1, 1)
    assert counts["unknown_resolved_absent"] == 1
    # A submission whose every request was unknown and whose job never appeared is not lost.
    second.requests = second.requests[:1]
    second.job_id = None
    del w.jobs[expected_job_id(second, SECRET)]
    if not second.submission.poison:
        del w.jobs[follow_up_job_id(expected_job_id(second, SECRET), NOTIFY)]
        w.keys = [k for k in w.keys if expected_job_id(second, SECRET) not in k]
    assert w.judge() == {}


def test_a_refused_request_that_created_a_job_and_stuck_rows_are_violations() -> None:
    w = World_(plan())
    w.records[0].requests = [Request(0.0, "failed", 422, "bad")]
    assert w.judge(unpublished=2) == {"failed_but_created": 1, "stuck": 2}


def test_leftover_messages_and_missed_faults_fail_the_run() -> None:
    w = World_(plan())
    violations = w.judge(
        depths={"jobrelay.work": 2, "jobrelay.quarantine": 1}, missed=("crash api: never",)
    )
    assert violations == {"broker_leftover": 2, "faults_missed": 1}
    assert summary_line(5, w.verdict, 1.0, 9).endswith("FAILED broker_leftover=2 faults_missed=1")


def test_copies_held_by_the_brokers_dead_letter_worker_are_reported_not_leftover() -> None:
    """Not deliverable (RabbitMQ 3.10 keeps them in messages_dlx after a leader change), so
    no work is left in them; counted and shown, while a deliverable leftover still fails."""
    w = World_(plan())
    assert w.judge(depths={"jobrelay.retry.2s": 0}, dead_lettering={"jobrelay.retry.2s": 9}) == {}
    assert w.verdict.counts["dead_lettering"] == 9
    assert w.verdict.examples["dead_lettering"] == [
        "jobrelay.retry.2s: 9 copies held by the broker's dead-letter worker"
    ]
    still = w.judge(depths={"jobrelay.retry.2s": 1}, dead_lettering={"jobrelay.retry.2s": 9})
    assert still == {"broker_leftover": 1}


# --- limits per key (issue 36): the most exports of one account running at once ----------


def on_account(w: World_, account: str, n: int) -> list[str]:
    """``n`` healthy exports, now all of ``account``."""
    ids = [r.job_id for r in w.records if r.job_id and not r.submission.poison][:n]
    for job_id in ids:
        job = w.jobs[job_id]
        w.jobs[job_id] = dataclasses.replace(job, params={**job.params, "accountId": account})
    assert len(ids) == n
    return ids


def ran(w: World_, job_id: str, *events: tuple[float, str]) -> None:
    """The job's claims and run ends, at these seconds after ``CREATED``."""
    for seconds, kind in events:
        w.runs.append(RunEvent(job_id, CREATED + timedelta(seconds=seconds), kind))


def test_more_exports_of_one_account_running_at_once_than_its_limit_fail_the_run() -> None:
    """Three exports of acme overlap between 2 s and 3 s: over a limit of 2, not of 3. The
    old checker had no such line: an overfilled key passed as OK."""
    w = World_(plan(jobs=6))
    a, b, c = on_account(w, "acme", 3)
    ran(w, a, (0, "claimed"), (3, "result_saved"))
    ran(w, b, (1, "claimed"), (4, "retry_scheduled"))
    ran(w, c, (2, "claimed"), (5, "result_saved"))
    assert w.judge(limit=2) == {"limit_overfilled": 1}
    assert w.verdict.counts["most_running"] == 3
    (example,) = w.verdict.examples["limit_overfilled"]
    assert example.startswith("acme: 3 running at 2026-01-01 12:00:12+00:00")
    assert all(job_id in example for job_id in (a, b, c))
    line = summary_line(5, w.verdict, 1.0, 9)
    assert " most_running=3/2 " in line and line.endswith("FAILED limit_overfilled=1")
    assert w.judge(limit=3) == {}
    assert " most_running=3/3 " in summary_line(5, w.verdict, 1.0, 9)
    assert w.judge() == {}  # no limit (--no-limits): counted and shown, not judged
    assert " most_running=3/off " in summary_line(5, w.verdict, 1.0, 9)


def test_a_takeover_is_the_same_run_and_a_slot_handed_on_at_one_instant_is_no_overlap() -> None:
    """A redelivery claiming an expired lease continues the run (and its slot): not a second
    job running. A job whose end and the next job's claim share a timestamp did not overlap
    it (the next could only be admitted once that end was written). A run the reconciler
    ended (``reconciled_lease_expired``) ends there; a lease_lost does not end a run."""
    w = World_(plan(jobs=6))
    a, b, c = on_account(w, "acme", 3)
    ran(w, a, (0, "claimed"), (1, "claimed"), (2, "lease_lost"), (3, "result_saved"))
    ran(w, b, (3, "claimed"), (4, "reconciled_lease_expired"))
    ran(w, c, (4, "claimed"), (5, "quarantined"), (6, "claimed"), (7, "cancelled"))
    assert w.judge(limit=1) == {}
    assert w.verdict.counts["most_running"] == 1
    assert w.verdict.examples["running_per_account"][0].startswith("acme: at most 1 at once")


def test_a_run_with_no_end_counts_as_running_and_a_slot_left_at_rest_fails() -> None:
    w = World_(plan(jobs=6))
    a, b = on_account(w, "globex", 2)
    ran(w, a, (0, "claimed"))  # its end never written
    ran(w, b, (10, "claimed"), (11, "result_saved"))
    assert w.judge(limit=1) == {"limit_overfilled": 1}
    w.runs = [e for e in w.runs if e.job_id != a]
    w.slots_held = 1
    assert w.judge(limit=1) == {"slots_at_rest": 1}
    assert w.verdict.examples["slots_at_rest"] == ["1 slots held in job_slots at rest"]


def test_the_soaks_app_is_the_shipped_one_with_its_export_limited_per_account() -> None:
    """What ``JOBRELAY_APP`` names for the soak's processes (``--limits``, the default)."""
    from jobrelay.chaos.limited_app import ACCOUNT_LIMIT, SPEC
    from jobrelay.domain.limits import CONCURRENCY, FAIR, JobLimit
    from jobrelay.exports import shipped
    from jobrelay.library.loader import load_app

    app = load_app(SPEC)
    assert set(app.jobs) == set(shipped.app.jobs) and app.included_types == {NOTIFY}
    assert set(app.commands) == set(shipped.app.commands) >= {"seed"}
    job = app.jobs[EXPORT].new_job({"accountId": "acme", "period": "2020-01"}, account="acme")
    fair = JobLimit(EXPORT, FAIR, key="acme")
    assert job.limits == (fair, JobLimit(f"{EXPORT}\x1facme", CONCURRENCY, max=ACCOUNT_LIMIT))
    assert ACCOUNT_LIMIT == 2
    shipped_job = shipped.report_export.new_job(
        {"accountId": "acme", "period": "2020-01"}, account="acme"
    )
    assert shipped_job.limits == (fair,)  # fair by account, with no limit
