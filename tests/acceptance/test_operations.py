"""Operations as the on-call engineer meets them, with real processes on SQLite + local transport:
``job show``, ``jobs list``, ``job replay``, ``jobs replay``, ``job cancel``, ``reconcile``,
JSON logs with the trace id from the HTTP request, and the ``--metrics-port`` endpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from .procs import FAST_ENV, Proc, clean_env, free_port, poll, processes, run_cli, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


@pytest.fixture
def env(tmp_path: Path, sqlite_template: Path) -> dict[str, str]:
    # A copy of the session's migrated template (`db upgrade` has tests of its own).
    shutil.copy(sqlite_template, tmp_path / "jr.db")
    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/jr.db",
        JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports",
        **FAST_ENV,
    )
    assert run_cli("seed", "--rows-per-month", "20", env=env).returncode == 0
    return env


def cli_ok(*args: str, env: dict[str, str]) -> str:
    result = run_cli(*args, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def token(env: dict[str, str], *args: str) -> str:
    return cli_ok("token", "create", *args, env=env).strip().splitlines()[-1]


def show(env: dict[str, str], job_id: str) -> dict[str, Any]:
    return dict(json.loads(cli_ok("job", "show", job_id, "--json", env=env)))


def wait_state(env: dict[str, str], job_id: str, state: str) -> dict[str, Any]:
    return poll(
        lambda: (doc := show(env, job_id))["state"] == state and doc,
        60,
        f"job {job_id} to be {state}",
    )


def json_lines(proc: Proc) -> list[dict[str, Any]]:
    """Every line the process wrote, each of which must be one JSON object."""
    return [json.loads(line) for line in proc.log().splitlines() if line.strip()]


@pytest.mark.long
def test_quarantine_replay_and_cancel_from_the_cli(env: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {token(env, '--account', 'acme')}"}
    faults = "export.run:invalid:1@period=2020-01"
    with processes(tmp_path) as start:
        # DEBUG: each job's lifecycle lines, read at the end (INFO has a line per batch).
        debug = {"JOBRELAY_FAULTS": faults, "JOBRELAY_LOG_LEVEL": "DEBUG"}
        up = start("up", "up", "--port", str(port), env={**env, **debug})
        wait_http(base, up)
        accepted = httpx.post(
            f"{base}/v1/exports",
            json={"accountId": "acme", "period": "2020-01"},
            headers={**auth, "traceparent": TRACEPARENT},
            timeout=10,
        )
        job_id = accepted.json()["jobId"]
        doc = wait_state(env, job_id, "quarantined")
        assert doc["traceId"] == TRACE_ID and "injected invalid" in doc["quarantineReason"]
        assert doc["attempts"][0]["outcome"] == "quarantined"
        assert doc["nextStep"].endswith(f"jobrelay job replay {job_id}")
        human = cli_ok("job", "show", job_id, env=env)
        assert "next: quarantined:" in human and "attempts" in human and TRACE_ID in human

        listed = cli_ok("jobs", "list", "--state", "quarantined", "--reason", "INJECTED", env=env)
        assert job_id in listed and "1 job(s)" in listed
        dry = cli_ok("jobs", "replay", "--reason", "injected", "--dry-run", env=env)
        assert f"would replay  {job_id}" in dry and "nothing changed" in dry
        assert show(env, job_id)["state"] == "quarantined"
        no_filter = run_cli("jobs", "replay", env=env)
        assert no_filter.returncode == 2 and "--reason" in no_filter.stderr

        replayed = cli_ok("job", "replay", job_id, "--reason", "fault fixed", env=env)
        assert "quarantined -> queued" in replayed
        done = wait_state(env, job_id, "succeeded")
        assert done["attempt"] == 2 and done["maxAttempts"] == 1 + 3
        event = next(e for e in done["events"] if e["kind"] == "replayed")
        assert event["detail"]["actor"].startswith("cli:") and event["detail"]["reason"] == (
            "fault fixed"
        )
        again = run_cli("job", "replay", job_id, env=env)
        assert again.returncode == 1
        assert "is succeeded; replay is allowed only from quarantined" in again.stderr
        refused = run_cli("job", "cancel", job_id, "--reason", "late", env=env)
        assert refused.returncode == 1
        assert refused.stderr.strip().endswith("already succeeded; nothing to cancel")
        missing = run_cli(
            "job", "cancel", "--reason", "x", "00000000-0000-0000-0000-000000000000", env=env
        )
        assert missing.returncode == 1 and "no job" in missing.stderr

        up.stop()
    # Everything the process logged is JSON, and the worker's lines for the job carry the trace.
    entries = json_lines(up)
    mine = [e for e in entries if e.get("jobId") == job_id and e["logger"] == "jobrelay.worker"]
    assert {e["event"] for e in mine} >= {"claimed", "quarantined", "result_saved", "ack_sent"}
    assert all(e.get("trace_id") == TRACE_ID for e in mine)
    assert all("attempt" in e for e in mine if e["event"] in ("claimed", "result_saved"))


def test_cancel_a_queued_job_and_reconcile_with_no_relay(env: dict[str, str]) -> None:
    # No processes: the job is accepted by the API, then nothing publishes it.
    job_id = _accept_offline(env)
    stale_env = {**env, "JOBRELAY_RECONCILE_GRACE_SECONDS": "0"}
    report = json.loads(cli_ok("reconcile", "--dry-run", "--json", env=stale_env))
    assert report["counts"]["outbox_stale"] == 1 and report["repaired"] == 0
    assert report["findings"][0]["jobId"] == job_id
    assert "is a relay running?" in report["findings"][0]["detail"]
    human = run_cli("reconcile", env=stale_env)
    assert human.returncode == 0 and human.stderr == ""  # findings once, on stdout
    assert human.stdout.startswith(
        "reconcile: 0 lease_expired, 0 retry_overdue, 0 queued_unclaimed, 1 outbox_stale"
    )

    assert show(env, job_id)["nextStep"].startswith("accepted ")
    cancelled = cli_ok(
        "job", "cancel", job_id, "--reason", "customer withdrew", "--actor", "bob", env=env
    )
    assert "cancelled" in cancelled and "(was queued)" in cancelled
    doc = show(env, job_id)
    assert doc["state"] == "cancelled"
    assert doc["events"][-1]["detail"] == {
        "actor": "bob",
        "reason": "customer withdrew",
        "previousState": "queued",
        # The export is fair by account: its message waited for its admission, unsent, and
        # is dropped with the cancel (never published).
        "heldMessagesDropped": 1,
    }
    empty = run_cli("job", "cancel", job_id, "--reason", " ", env=env)
    assert empty.returncode == 2


def _accept_offline(env: dict[str, str]) -> str:
    """Accept one job through a short-lived API process, then stop it."""
    import tempfile

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {token(env, '--account', 'acme')}"}
    with tempfile.TemporaryDirectory() as logs, processes(Path(logs)) as start:
        api = start("api", "api", "--port", str(port), env=env)
        wait_http(base, api)
        response = httpx.post(
            f"{base}/v1/exports", json={"accountId": "acme", "period": "2020-03"}, headers=auth
        )
        assert response.status_code == 202
        return str(response.json()["jobId"])


def test_separate_processes_log_json_and_serve_metrics(env: dict[str, str], tmp_path: Path) -> None:
    api_port, relay_port, worker_port = free_port(), free_port(), free_port()
    base = f"http://127.0.0.1:{api_port}"
    secret = token(env, "--account", "acme")
    auth = {"Authorization": f"Bearer {secret}"}
    with processes(tmp_path) as start:
        api = start("api", "api", "--port", str(api_port), env=env)
        # DEBUG: the job's own published and result_saved lines, read at the end (INFO: a
        # line per batch).
        relay_env = {**env, "JOBRELAY_LOG_LEVEL": "DEBUG"}
        relay = start("relay", "relay", "--metrics-port", str(relay_port), env=relay_env)
        worker_env = {
            **env,
            "JOBRELAY_METRICS_PORT": str(worker_port),
            "JOBRELAY_LOG_LEVEL": "DEBUG",
        }
        worker = start("worker", "worker", env=worker_env)
        wait_http(base, api)
        response = httpx.post(
            f"{base}/v1/exports",
            json={"accountId": "acme", "period": "2020-05"},
            headers={**auth, "traceparent": TRACEPARENT},
            timeout=10,
        )
        job_id = response.json()["jobId"]
        wait_state(env, job_id, "succeeded")

        def page(port: int) -> str | None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            except httpx.HTTPError:
                return None
            return r.text if r.status_code == 200 else None

        relay_page = poll(lambda: page(relay_port), 20, "the relay's metrics")
        worker_page = poll(lambda: page(worker_port), 20, "the worker's metrics")
        api_page = httpx.get(f"{base}/metrics", timeout=5).text
        assert 'jobrelay_publish_seconds_count{outcome="confirmed"}' in relay_page
        assert "jobrelay_outbox_unpublished 0.0" in relay_page
        assert "jobrelay_reconcile_leader 1.0" in relay_page
        assert 'outcome="succeeded",type="report.export"' in worker_page
        assert 'jobrelay_job_transitions_total{from_state="new",to_state="queued"} 1.0' in api_page
        for proc in (api, relay, worker):
            proc.stop()

    for proc, must_see in (
        (api, "job_accepted"),
        (relay, "published"),
        (worker, "result_saved"),
    ):
        entries = json_lines(proc)  # each line parses: one JSON object per line
        [line] = [e for e in entries if e.get("event") == must_see and e.get("jobId") == job_id]
        assert line["trace_id"] == TRACE_ID, (proc.name, line)
        assert secret not in proc.log() and secret[3:] not in proc.log()
