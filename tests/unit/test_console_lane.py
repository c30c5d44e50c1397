"""The console's hand-off lane (static/lane.js) drawn from the final attempt's own events
(issue 21, item 9), checked by running the pure function in node."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import jobrelay

LANE_JS = Path(jobrelay.__file__).parent / "api" / "static" / "lane.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def lane(events: list[tuple[str, str]]) -> list[tuple[str, str, str | None]]:
    assert NODE is not None
    given = [{"kind": kind, "at": f"2026-12-01T09:{at}Z", "detail": {}} for kind, at in events]
    script = (
        f"const {{ handoffLane }} = require({json.dumps(str(LANE_JS))});"
        f"process.stdout.write(JSON.stringify(handoffLane({json.dumps(given)})));"
    )
    out = subprocess.run([NODE, "-e", script], capture_output=True, text=True, check=True)
    stages: list[dict[str, Any]] = json.loads(out.stdout)
    return [(s["kind"], s["label"], s["at"] and s["at"][14:-1]) for s in stages]


def test_a_job_that_succeeded_on_attempt_3_shows_attempt_3s_hand_offs() -> None:
    events = [
        ("accepted", "06:00"), ("published", "06:01"),
        ("claimed", "06:02"), ("retry_scheduled", "06:03"), ("ack_sent", "07:05"),
        ("published", "06:30"), ("claimed", "06:31"), ("retry_scheduled", "06:32"),
        ("ack_sent", "06:33"),
        ("published", "06:59"), ("claimed", "07:00"), ("result_saved", "07:10"),
        ("ack_sent", "07:11"),
    ]  # fmt: skip
    assert lane(events) == [
        ("accepted", "accepted", "06:00"),
        ("published", "published", "06:59"),
        ("claimed", "claimed", "07:00"),
        ("result_saved", "saved", "07:10"),
        ("ack_sent", "acked", "07:11"),  # not attempt 1's ack at 07:05
    ]


def test_a_quarantined_job_shows_its_quarantine_and_reject() -> None:
    events = [
        ("accepted", "06:00"), ("published", "06:01"), ("claimed", "06:02"),
        ("quarantined", "06:03"), ("rejected", "06:04"),
    ]  # fmt: skip
    assert lane(events)[3:] == [
        ("quarantined", "quarantined", "06:03"),
        ("rejected", "rejected", "06:04"),
    ]


def test_a_job_quarantined_on_delivery_has_no_claim() -> None:
    events = [("accepted", "06:00"), ("published", "06:01"), ("quarantined", "06:02")]
    assert lane(events) == [
        ("accepted", "accepted", "06:00"),
        ("published", "published", "06:01"),
        ("claimed", "claimed", None),
        ("quarantined", "quarantined", "06:02"),
        ("ack_sent", "acked", None),
    ]


def test_a_running_job_waits_for_its_outcome() -> None:
    events = [("accepted", "06:00"), ("published", "06:01"), ("claimed", "06:02")]
    assert [at for _, _, at in lane(events)] == ["06:00", "06:01", "06:02", None, None]
