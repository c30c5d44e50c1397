"""What an account token can read of its own job: every field, and none of the operators'.

A job is taken through retries, a quarantine, an admin replay and an admin cancel, and its
timeline also gets the events other processes write (relay, reconciler, a second worker, the
e-mail effect), each with the details a real one carries: worker and relay host names,
operator identities and notes, and errors quoting internal endpoints. The account's
``GET /v1/jobs/{id}``, ``/events`` and ``/explain`` are then read back and (1) the set of
fields it can see is compared with the list below, (2) none of the planted private strings
appears anywhere, (3) the admin token sees all of them, so the plant is real.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from jobrelay.domain.disclosure import TEMPORARY, public_error
from jobrelay.domain.states import JobState
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.records import PendingEvent
from tests.integration.api_fixtures import T0, Clock, api_client, bearer, build_runtime, make_token

from .ops_fixtures import LEASE, new_job

pytestmark = pytest.mark.timeout(60)

WORKER = "db-host.internal:4242:abcdef"
S3_ERROR = (
    "result store failed: Could not connect to the endpoint URL: "
    '"https://s3.eu-west-1.internal.example:9000/bucket/exports/acme/x.csv"'
)
PG_ERROR = 'connection to server at "pg-primary" (10.0.0.5), port 5432 failed'
REPLAY_NOTE = "customer called; see ticket SEC-42"
CANCEL_NOTE = "fraud suspected by risk team"
# The last failure's traceback (jobs.last_traceback): operators' only.
TRACEBACK = 'Traceback (most recent call last):\n  File "/srv/vault-agent/job.py"\nOSError\n'
# Every string an account must never read. Each appears in the admin's view (checked below).
PRIVATE = (
    "db-host.internal",
    "s3.eu-west-1",
    "pg-primary",
    "10.0.0.5",
    "token#",
    "tester-admin",
    "SEC-42",
    "fraud",
    "mq-host.internal",
    "web-9.internal",
    "ops-host",
    "smtp.corp.internal",
    "cli:root@",
    "/srv/vault-agent",
)

# The whole account view, field by field. A field added to an event, the job or the
# explanation must be added here on purpose (and to docs/security.md) to become visible.
ACCOUNT_JOB_FIELDS = {
    "jobId",
    "type",
    "accountId",
    "params",
    "state",
    "published",
    "attempt",
    "maxAttempts",
    "resultKey",
    "result",
    "lastError",
    "nextAttemptAt",
    "runAt",
    "progress",
    "waitingFor",
    "createdAt",
    "updatedAt",
}
ACCOUNT_EXPLAIN_FIELDS = {
    "jobId",
    "type",
    "accountId",
    "params",
    "state",
    "published",
    "unpublishedSince",
    "attempt",
    "maxAttempts",
    "lastError",
    "quarantineReason",
    "nextAttemptAt",
    "runAt",
    "resultKey",
    "result",
    "after",
    "progress",
    "traceId",
    "createdAt",
    "updatedAt",
    "attempts",
    "nextStep",
    "events",
}
ACCOUNT_ATTEMPT_FIELDS = {"attempt", "startedAt", "outcome", "error", "endedAt", "durationSeconds"}
ACCOUNT_EVENT_FIELDS = {
    "accepted": {"type"},  # and runAt for a delayed job (not enqueued here)
    "claimed": {"attempt"},  # the store's claim; a delivery adds redelivered (unit test)
    "published": set(),
    "retry_scheduled": {"error", "delaySeconds", "nextAttemptAt", "attempt"},
    "deferred": {"delaySeconds"},
    "lease_lost": {"attempt", "currentAttempt", "currentState"},
    "reconciled_lease_expired": {"leaseExpiredAt", "attempt"},
    "effect_refused": {"effect", "state", "error"},
    "quarantined": {"reason", "attempt"},
    "replayed": {"previousReason", "attempt", "maxAttempts"},
    "cancelled": {"previousState"},
}


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path, clock=Clock())
    yield rt
    await rt.engine.dispose()


async def leaky_job(rt: Runtime, client: httpx.AsyncClient, admin: dict[str, str]) -> str:
    """A job whose timeline holds every kind of private detail, written as the pipeline does."""
    store = rt.store
    job_id, _ = await store.submit(await new_job(store), T0)
    claim = await store.claim_job(job_id, WORKER, T0, LEASE)
    assert claim is not None
    public = public_error(TEMPORARY)
    assert (await store.schedule_retry(claim, "report.export", S3_ERROR, 5, T0, public=public)).won
    assert isinstance(rt.clock, Clock)
    later = rt.clock.advance(6)  # the retry is due
    claim = await store.claim_job(job_id, WORKER, later, LEASE)
    assert claim is not None
    reason = f"attempts exhausted (2/3): {PG_ERROR}"
    assert await store.quarantine(job_id, reason, T0, claim=claim, traceback=TRACEBACK)
    await store.record_events(
        [
            PendingEvent(
                job_id,
                "published",
                T0,
                {"destination": "work", "outboxId": 7, "relay": "relay:mq-host.internal:7:abc123"},
            ),
            PendingEvent(
                job_id,
                "deferred",
                T0,
                {"reason": "lease held by web-9.internal:1:abcdef", "delaySeconds": 5},
            ),
            PendingEvent(
                job_id,
                "lease_lost",
                T0,
                {
                    "worker": "web-9.internal:1:abcdef",
                    "attempt": 1,
                    "currentAttempt": 2,
                    "currentState": "running",
                },
            ),
            PendingEvent(
                job_id,
                "reconciled_lease_expired",
                T0,
                {
                    "actor": "reconciler:ops-host:1:abcdef",
                    "worker": WORKER,
                    "leaseExpiredAt": T0.isoformat(),
                    "attempt": 1,
                },
            ),
            PendingEvent(
                job_id,
                "effect_refused",
                T0,
                {
                    "effect": "email",
                    "state": "failed",
                    "error": "SMTP smtp.corp.internal:25 refused: 554 relay denied",
                },
            ),
        ]
    )
    replayed = await client.post(
        f"/v1/jobs/{job_id}/replay", json={"reason": REPLAY_NOTE}, headers=admin
    )
    assert replayed.status_code == 200, replayed.text
    cancelled = await client.post(
        f"/v1/jobs/{job_id}/cancel", json={"reason": CANCEL_NOTE}, headers=admin
    )
    assert cancelled.status_code == 200, cancelled.text
    # A CLI operator's identity, as `jobrelay job replay` writes it.
    await store.record_events(
        [PendingEvent(job_id, "replayed", T0, {"actor": "cli:root@ops-host", "reason": "x"})]
    )
    return job_id


async def test_an_account_token_sees_its_jobs_story_and_nothing_of_the_operators(
    runtime: Runtime,
) -> None:
    async with api_client(runtime) as client:
        # The admin's label is what the replay and cancel events name.
        admin = bearer(await _labelled_admin(runtime))
        acme = bearer(await make_token(runtime, "acme"))
        job_id = await leaky_job(runtime, client, admin)

        views = {}
        for path in ("", "/events", "/explain"):
            response = await client.get(f"/v1/jobs/{job_id}{path}", headers=acme)
            assert response.status_code == 200, response.text
            views[path] = response.json()
        admin_text = json.dumps(
            [
                (await client.get(f"/v1/jobs/{job_id}{path}", headers=admin)).json()
                for path in ("", "/events", "/explain")
            ]
        )

    for private in PRIVATE:
        assert private in admin_text, f"the plant {private!r} is missing from the admin view"
        for path, view in views.items():
            assert private not in json.dumps(view), (private, path)

    assert set(views[""]) == ACCOUNT_JOB_FIELDS
    explain = views["/explain"]
    assert set(explain) == ACCOUNT_EXPLAIN_FIELDS
    assert explain["attempts"] and all(
        set(a) == ACCOUNT_ATTEMPT_FIELDS for a in explain["attempts"]
    )
    for events in (views["/events"]["events"], explain["events"]):
        seen: dict[str, set[str]] = {}
        for event in events:
            assert set(event) == {"at", "kind", "detail"}
            seen.setdefault(event["kind"], set()).update(event["detail"])
        assert seen == ACCOUNT_EVENT_FIELDS

    # The errors are still there for the customer, as a code and a message for customers.
    retry = next(e for e in views["/events"]["events"] if e["kind"] == "retry_scheduled")
    assert retry["detail"]["error"] == public_error(TEMPORARY)
    assert explain["state"] == JobState.CANCELLED.value
    assert explain["nextStep"] == "cancelled by an operator; it will not run"
    assert "pg-primary" not in (views[""]["lastError"] or "")


async def _labelled_admin(runtime: Runtime) -> str:
    from jobrelay.api.auth import hash_token, new_token

    token = new_token()
    await runtime.store.add_token(hash_token(token), None, True, T0, "tester-admin")
    return token


def test_every_event_kind_in_the_reference_has_an_account_rule() -> None:
    """Deny by default is only safe if each documented kind was looked at: a kind missing
    from ``ACCOUNT_EVENT_FIELDS`` would show an empty detail, and should be a decision."""
    from jobrelay.domain.disclosure import ACCOUNT_EVENT_FIELDS as RULES

    reference = Path(__file__).parents[2] / "docs" / "reference" / "events.md"
    # The job events' table: from "## Kinds" to the next section (schedules have their own).
    kinds = reference.read_text().split("\n## Kinds\n", 1)[1].split("\n## ", 1)[0]
    documented = {
        line.split("`")[1]
        for line in kinds.splitlines()
        if line.startswith("| `") and line.count("|") >= 4
    }
    assert documented and documented <= set(RULES), documented - set(RULES)
