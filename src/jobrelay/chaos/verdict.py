"""The soak's checker: from what the clients saw and what the world holds, lost or doubled?

Pure: it takes the facts (the clients' records, the database, the bucket's keys, the mail
sink's messages, the broker's queues, which faults fired) and returns the counts. The
definitions follow the Jepsen-style checker this soak is modelled on:

- lost: a job the API accepted (some request got a jobId) that is missing or not finished,
  or a finished export whose e-mail job is missing or not finished;
- stuck: any job in the database that is not terminal, or any outbox row not published;
- duplicate results: a second ``result_saved`` for a job, or a second object for one job;
- duplicate e-mails: a second message with one Message-ID, unless the notification's ledger
  says ``possible_duplicate`` (the documented SMTP window), which is counted apart;
- quarantined must be exactly the poison jobs;
- every ``unknown`` request is resolved from the database: it committed the job (the row was
  created while it was in flight), an earlier request had, or it did not commit anything;
- under a limit per account (``limit``, the soak's default): never more exports of one
  account running at once than the limit, counted from their timelines (``running``), and
  no slot held once every job has finished (``job_slots`` empty at rest).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from jobrelay.chaos.clients import Record
from jobrelay.chaos.running import overfilled, running_peaks
from jobrelay.domain.ids import follow_up_job_id, job_id_for
from jobrelay.domain.states import JobState
from jobrelay.storage.audit import Facts

EXPORT, NOTIFY = "report.export", "notify.email"
POSSIBLE_DUPLICATE = "possible_duplicate"
CLOCK_SLACK = 0.05  # seconds; the API and the clients read one machine's clock


@dataclass(frozen=True)
class Mail:
    message_id: str
    to: tuple[str, ...]


@dataclass(frozen=True)
class World:
    """What the checker reads, besides the database: broker, bucket, mail sink, faults."""

    object_keys: tuple[str, ...]
    open_uploads: int
    mails: tuple[Mail, ...]
    queue_depths: dict[str, int]
    dead_letters: tuple[tuple[str | None, str | None], ...]  # (job id, reason) per message
    faults_missed: tuple[str, ...]  # planned faults that could not be injected or never fired
    # Copies a quorum queue's at-least-once dead-letter worker still holds (messages_dlx):
    # not deliverable, so not leftover work; reported (see docs/how-to/scale-out.md).
    dead_lettering: dict[str, int] = field(default_factory=dict)


@dataclass
class Verdict:
    counts: dict[str, int]
    violations: dict[str, int]
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())


def expected_job_id(record: Record, id_secret: bytes) -> str:
    """The id the API gives the record's request (always with an Idempotency-Key), keyed with
    the installation's ``id_secret`` as the API keyed it."""
    s = record.submission
    return job_id_for(id_secret, s.account, EXPORT, {}, s.key)


def judge(records: list[Record], facts: Facts, world: World, limit: int | None = None) -> Verdict:
    """``limit``: the exports' concurrency limit per account (None: they ran without one)."""
    examples: dict[str, list[str]] = {}

    def note(kind: str, what: str) -> None:
        examples.setdefault(kind, [])
        if len(examples[kind]) < 10:
            examples[kind].append(what)

    jobs = facts.jobs
    requests = Counter(r.outcome for rec in records for r in rec.requests)
    accepted = lost = failed_but_created = id_mismatch = 0
    unknown_created = unknown_absent = unknown_existed = 0
    poison_ids: set[str] = set()
    for rec in records:
        job_id = expected_job_id(rec, facts.id_secret)
        job = jobs.get(job_id)
        if rec.submission.poison:
            poison_ids.add(job_id)
        if job is not None:
            accepted += 1
        if rec.job_id is not None and rec.job_id != job_id:
            id_mismatch += 1
            note("id_mismatch", f"{rec.submission.key}: answered {rec.job_id}, expected {job_id}")
        for request in rec.requests:
            if request.outcome != "unknown":
                continue
            # Resolved by when the job row was created: during this request (it committed and
            # the answer was lost), before it (an earlier request did), or not by it at all.
            created = job.created_at.timestamp() if job is not None else None
            if created is None or created > request.ended + CLOCK_SLACK:
                unknown_absent += 1
            elif created < request.started - CLOCK_SLACK:
                unknown_existed += 1
            else:
                unknown_created += 1
        if rec.outcome == "ok" and (job is None or not job.state.is_terminal):
            lost += 1
            note("lost", f"{job_id}: {'missing' if job is None else job.state.value}")
        if rec.outcome == "failed" and job is not None:
            failed_but_created += 1
            note("failed_but_created", job_id)

    # Each succeeded export with an address owes exactly one finished notification job.
    exports = [j for j in jobs.values() if j.type == EXPORT]
    for job in exports:
        if job.state is JobState.SUCCEEDED and job.params.get("notifyEmail"):
            notify = jobs.get(follow_up_job_id(job.id, NOTIFY))
            if notify is None or not notify.state.is_terminal:
                lost += 1
                note("lost", f"notification of {job.id}: {notify.state if notify else 'missing'}")

    stuck = sum(1 for j in jobs.values() if not j.state.is_terminal)
    for j in jobs.values():
        if not j.state.is_terminal:
            note("stuck", f"{j.id} {j.type} {j.state.value} attempt {j.attempt}: {j.last_error}")

    # Results: at most one write and one object per job; exactly one per succeeded export.
    dup_results = sum(max(0, c["result_saved"] - 1) for c in facts.events.values())
    dup_results_events = dup_results
    succeeded_exports = {j.id for j in exports if j.state is JobState.SUCCEEDED}
    orphan_results = stray_results = missing_results = 0
    # An S3 result is uploaded under its attempt's own key before the completion names it:
    # an object of a succeeded export that its resultKey does not name was left by an
    # attempt that died between its upload and its completion. Never served: an orphan.
    named = {j.id: j.result_key for j in exports if j.id in succeeded_exports and j.result_key}
    per_job: Counter[str] = Counter()
    for key in world.object_keys:
        job_id = _job_of_key(key)
        result_key = named.get(job_id)
        if result_key is not None and _attempt_of(key) != _attempt_of(result_key):
            orphan_results += 1
            note("orphan_results", f"{job_id}: {key}, not its resultKey {result_key}")
            continue
        per_job[job_id] += 1
    for job_id, n in per_job.items():
        if n > 1:
            dup_results += n - 1
            note("dup_results", f"{job_id}: {n} objects")
        if job_id not in jobs:
            stray_results += n
            note("stray_results", f"{job_id}: no such job")
        elif job_id not in succeeded_exports:
            orphan_results += n
            note("orphan_results", f"{job_id}: {jobs[job_id].state.value}")
    for job_id in succeeded_exports:
        if per_job.get(job_id, 0) == 0:
            missing_results += 1
            note("missing_results", job_id)

    # E-mails: one per Message-ID, except in the documented window.
    by_id = Counter(m.message_id for m in world.mails)
    ledger_by_message = {mid: (job, state) for job, (state, mid) in facts.effects.items()}
    dup_emails = window_dup_emails = 0
    for message_id, n in by_id.items():
        if n < 2:
            continue
        _, state = ledger_by_message.get(message_id, ("?", "?"))
        if state == POSSIBLE_DUPLICATE:
            window_dup_emails += n - 1
        else:
            dup_emails += n - 1
            note("dup_emails", f"{message_id}: {n} copies, ledger {state}")
    missing_emails = 0
    for job in jobs.values():
        if job.type == NOTIFY and job.state is JobState.SUCCEEDED:
            _, message_id = facts.effects.get(job.id, ("?", ""))
            if by_id.get(message_id, 0) == 0:
                missing_emails += 1
                note("missing_emails", f"{job.id} ({message_id or 'no ledger row'})")

    quarantined = {j.id for j in jobs.values() if j.state is JobState.QUARANTINED}
    wrongly_quarantined = quarantined - poison_ids
    poison_escaped = poison_ids - quarantined
    for job_id in sorted(wrongly_quarantined):
        note("wrongly_quarantined", f"{job_id}: {jobs[job_id].quarantine_reason}")
    for job_id in sorted(poison_escaped):
        note("poison_not_quarantined", f"{job_id}: {jobs[job_id].state if job_id in jobs else '-'}")

    leftover = {q: n for q, n in world.queue_depths.items() if n and "quarantine" not in q}
    for queue, n in leftover.items():
        note("broker_leftover", f"{queue}: {n} messages")
    # A dead letter for a job that finished otherwise (the delivery limit, then the reconciler):
    # recovered, not a violation; the job itself is judged above.
    recovered_dead_letters = 0
    for dead, reason in world.dead_letters:
        if dead is None or dead not in quarantined:
            recovered_dead_letters += 1
            state = jobs[dead].state.value if dead is not None and dead in jobs else "unknown job"
            note("recovered_dead_letters", f"{dead}: dead-lettered ({reason}), job is {state}")
    for fault in world.faults_missed:
        note("faults_missed", fault)
    for queue, n in world.dead_lettering.items():
        if n:
            note("dead_lettering", f"{queue}: {n} copies held by the broker's dead-letter worker")

    # Limits per key: the most exports of one account running at once, from the timelines.
    accounts = {j.id: str(j.params.get("accountId")) for j in exports}
    peaks = running_peaks(facts.runs, accounts.get)
    most_running = max((p.most for p in peaks.values()), default=0)
    over = overfilled(peaks, limit) if limit is not None else Counter()
    for account, peak in sorted(peaks.items()):
        note(
            "running_per_account",
            f"{account}: at most {peak.most} at once (limit {limit or 'none'}), first at {peak.at}",
        )
    for account in sorted(over):
        peak = peaks[account]
        note("limit_overfilled", f"{account}: {peak.most} running at {peak.at}: {peak.jobs}")
    if facts.slots_held:
        note("slots_at_rest", f"{facts.slots_held} slots held in job_slots at rest")

    counts = {
        "submissions": len(records),
        "requests_ok": requests["ok"],
        "requests_failed": requests["failed"],
        "requests_unknown": requests["unknown"],
        "unknown_resolved_created": unknown_created,
        "unknown_resolved_absent": unknown_absent,
        "unknown_resolved_existed": unknown_existed,
        "accepted": accepted,
        "jobs_total": len(jobs),
        "exports_succeeded": len(succeeded_exports),
        "emails_received": len(world.mails),
        "result_objects": len(world.object_keys),
        # Written by an attempt that died before its commit, for a job that never succeeded:
        # never served (only a succeeded job has a result), replaced if the job is replayed.
        "orphan_results": orphan_results,
        "open_multipart_uploads": world.open_uploads,
        "quarantined": len(quarantined),
        "poison": len(poison_ids),
        "window_dup_emails": window_dup_emails,
        "dup_result_events": dup_results_events,
        "recovered_dead_letters": recovered_dead_letters,
        "dead_lettering": sum(world.dead_lettering.values()),
        "outbox_unpublished": facts.unpublished,
        "running_limit": limit or 0,  # 0: no limit
        "most_running": most_running,
    }
    violations = {
        "lost": lost,
        "stuck": stuck + facts.unpublished,
        "dup_results": dup_results,
        "dup_emails": dup_emails,
        "missing_results": missing_results,
        "stray_results": stray_results,
        "missing_emails": missing_emails,
        "wrongly_quarantined": len(wrongly_quarantined),
        "poison_not_quarantined": len(poison_escaped),
        "failed_but_created": failed_but_created,
        "id_mismatch": id_mismatch,
        "broker_leftover": sum(leftover.values()),
        "faults_missed": len(world.faults_missed),
        "limit_overfilled": sum(over.values()),
        "slots_at_rest": facts.slots_held,
    }
    return Verdict(counts, violations, examples)


_ATTEMPT_TAG = re.compile(r"\.attempt-(\d+)$")


def _job_of_key(key: str) -> str:
    """``prefix/exports/acme/<jobId>[.attempt-<n>].csv`` → ``<jobId>``."""
    return _ATTEMPT_TAG.sub("", key.rsplit("/", 1)[-1].removesuffix(".csv"))


def _attempt_of(key: str) -> str | None:
    """The attempt an object's key names (``.attempt-<n>``), None for a key without one."""
    found = _ATTEMPT_TAG.search(key.rsplit("/", 1)[-1].removesuffix(".csv"))
    return found.group(1) if found else None


def summary_line(seed: int, verdict: Verdict, elapsed: float, faults: int) -> str:
    c, v = verdict.counts, verdict.violations
    extra = " ".join(f"{k}={n}" for k, n in v.items() if n and k not in _HEADLINE)
    return (
        f"chaos: accepted={c['accepted']} lost={v['lost']} stuck={v['stuck']} "
        f"dup_results={v['dup_results']} dup_emails={v['dup_emails']} "
        f"window_dup_emails={c['window_dup_emails']} "
        f"quarantined={c['quarantined']}/{c['poison']} "
        f"unknown={c['requests_unknown']} (committed={c['unknown_resolved_created']} "
        f"not_committed={c['unknown_resolved_absent']} "
        f"earlier={c['unknown_resolved_existed']}) "
        f"most_running={c['most_running']}/{c['running_limit'] or 'off'} "
        f"faults={faults} seed={seed} "
        f"elapsed={elapsed:.0f}s {'OK' if verdict.ok else 'FAILED'}"
        + (f" {extra}" if extra else "")
    )


_HEADLINE = frozenset({"lost", "stuck", "dup_results", "dup_emails"})


def as_json(verdict: Verdict) -> dict[str, Any]:
    return {
        "ok": verdict.ok,
        "counts": verdict.counts,
        "violations": verdict.violations,
        "examples": verdict.examples,
    }
