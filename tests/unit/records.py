"""A ``JobRecord`` built by hand, for pure tests that need one without a database."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from jobrelay.domain.states import JobState
from jobrelay.storage.store import JobRecord

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
JOB_ID = "355781a6-5d2a-57ff-a430-b2902eefab0f"


def job_record(**changes: Any) -> JobRecord:
    base = JobRecord(
        id=JOB_ID,
        type="report.export",
        account_id="acme",
        params={"accountId": "acme", "period": "2020-05"},
        idempotency_key=None,
        state=JobState.QUEUED,
        attempt=0,
        max_attempts=3,
        result_key=None,
        result_meta=None,
        last_error=None,
        quarantine_reason=None,
        next_attempt_at=None,
        lease_owner=None,
        lease_expires_at=None,
        progress_done=None,
        progress_total=None,
        created_at=NOW - timedelta(seconds=40),
        updated_at=NOW - timedelta(seconds=40),
        published=True,
        unpublished_since=None,
        last_publish_error=None,
    )
    return dataclasses.replace(base, **changes)
