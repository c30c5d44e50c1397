"""The console as an operator's dashboard, in headless Chromium on a running pipeline.

One ``jobrelay up`` (SQLite, local transport) serves every test of this module. Three of
acme's jobs are quarantined by an injected fault on their first attempt, three more of acme's
and one of globex's succeed. Through the page: the overview, jobs list, queues, schedules and
job view render these real jobs; filters narrow the list; a bulk replay of the quarantined
jobs by reason runs to the end (the database then shows a ``replayed`` event per job naming
the admin token); pausing the default queue stops its deliveries (the jobs submitted meanwhile
stay queued, published, unclaimed) and resuming drains them; an account token sees only its
own account's jobs and no operator details. Each view is saved at 1280 and 390 px, light and
dark, under test-artifacts/dashboard/.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import pytest

from .procs import FAST_ENV, Proc, clean_env, free_port, poll, processes, run_cli, wait_http
from .test_console import (  # noqa: F401 (the module's browser)
    ARTIFACTS,
    TIMEOUT_MS,
    browser,
    overflowing,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
POISONED = ("2020-01", "2020-02", "2020-03")
FINE = ("2020-04", "2020-05", "2020-06")
RETRIED = "2020-08"  # fails once, transiently: it waits RETRY_SECONDS in retry_wait
RETRY_SECONDS = 600
PHONE = {"width": 390, "height": 844}
SHOTS = ARTIFACTS / "dashboard"
VIEWS = ("overview", "jobs", "queues", "schedules", "lookup")
WIDE = {"width": 1280, "height": 900}


@dataclass
class Stack:
    base: str
    env: dict[str, str]
    admin: str
    acme: str
    up: Proc
    quarantined: list[str]
    succeeded: list[str]
    globex: str

    def show(self, job_id: str) -> dict[str, Any]:
        return explain(self.base, self.admin, job_id)


def cli_ok(*args: str, env: dict[str, str]) -> str:
    result = run_cli(*args, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def explain(base: str, admin: str, job_id: str) -> dict[str, Any]:
    """What ``jobrelay job show --json`` prints, over HTTP (a CLI process per poll is slow)."""
    response = httpx.get(
        f"{base}/v1/jobs/{job_id}/explain",
        headers={"Authorization": f"Bearer {admin}"},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def submit(stack_base: str, token: str, account: str, period: str) -> str:
    response = httpx.post(
        f"{stack_base}/v1/exports",
        json={"accountId": account, "period": period},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert response.status_code == 202, response.text
    return str(response.json()["jobId"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("dashboard")
    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{tmp}/jr.db",
        JOBRELAY_RESULTS_URL=f"file://{tmp}/exports",
        **{**FAST_ENV, "JOBRELAY_RETRY_DELAYS": str(RETRY_SECONDS)},  # pause polls every 0.2 s
    )
    cli_ok("db", "upgrade", env=env)
    cli_ok("seed", "--rows-per-month", "20", env=env)
    admin = cli_ok("token", "create", "--admin", "--label", "support-console", env=env)
    tokens = {"admin": admin.strip().splitlines()[-1]}
    for account in ("acme", "globex"):
        made = cli_ok("token", "create", "--account", account, env=env)
        tokens[account] = made.strip().splitlines()[-1]
    faults = ",".join(f"export.run:invalid:1@period={p}" for p in POISONED)
    faults += f",export.run:transient:1@period={RETRIED}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with processes(tmp) as start:
        up = start("up", "up", "--port", str(port), env={**env, "JOBRELAY_FAULTS": faults})
        wait_http(base, up)
        quarantined = [submit(base, tokens["acme"], "acme", p) for p in POISONED]
        succeeded = [submit(base, tokens["acme"], "acme", p) for p in FINE]
        globex = submit(base, tokens["globex"], "globex", "2020-07")
        stack = Stack(
            base, env, tokens["admin"], tokens["acme"], up, quarantined, succeeded, globex
        )
        for job_id in quarantined:
            poll(lambda j=job_id: stack.show(j)["state"] == "quarantined", 60, "a quarantine")
        for job_id in [*succeeded, globex]:
            poll(lambda j=job_id: stack.show(j)["state"] == "succeeded", 60, "a success")
        yield stack


def open_console(browser: Any, stack: Stack, token: str, **context: Any) -> tuple[Any, list[str]]:  # noqa: F811
    page = browser.new_context(**context).new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # A 404 the page did not mean (a missing asset); the browser's own favicon.ico is fine.
    page.on(
        "response",
        lambda r: (
            r.status == 404
            and "/v1/" not in r.url
            and not r.url.endswith("/favicon.ico")
            and errors.append(f"404 {r.url}")
        ),
    )
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto(f"{stack.base}/console")
    page.fill("#token", token)
    page.click("#use-token")
    return page, errors


def test_every_view_renders_real_data_and_filters_narrow_the_list(
    browser: Any,  # noqa: F811
    stack: Stack,
) -> None:
    from playwright.sync_api import expect

    page, errors = open_console(browser, stack, stack.admin, viewport=WIDE)
    expect(page.locator("#whoami")).to_have_text("admin token")
    expect(page.locator("#overview")).to_have_attribute("data-loaded", "true")
    expect(page.locator('#state-counts [data-state="quarantined"] .big')).to_have_text("3")
    expect(page.locator('#state-counts [data-state="succeeded"] .big')).to_have_text("4")
    expect(page.locator('#type-counts tr[data-name="report.export"]')).to_contain_text("7")
    expect(page.locator("#throughput-chart canvas")).to_have_count(1)
    expect(page.locator("#throughput-summary")).to_contain_text("7 accepted")
    expect(page.locator("#throughput-summary")).to_contain_text("3 quarantined")
    expect(page.locator('#queue-list tr[data-queue="default"]')).to_contain_text("consuming")
    expect(page.locator("#reconciler-summary")).to_have_text("Nothing fell between two hand-offs.")
    expect(page.locator('#process-list tr[data-role="worker"]')).to_have_count(1)
    expect(page.locator('#process-list tr[data-role="relay"]')).to_have_count(1)
    expect(page.locator('#process-list tr[data-role="worker"]')).to_contain_text(str(stack.up.pid))

    rows = page.locator("#job-list tbody tr")
    expect(rows).to_have_count(7)
    page.select_option("#f-state", "quarantined")
    page.click("#jobs-search")
    expect(rows).to_have_count(3)
    expect(page.locator('#job-list tr[data-state="quarantined"]')).to_have_count(3)
    page.select_option("#f-state", "")
    page.fill("#f-account", "globex")
    page.click("#jobs-search")
    expect(rows).to_have_count(1)
    expect(page.locator(f'#job-list tr[data-job-id="{stack.globex}"]')).to_have_count(1)
    page.fill("#f-account", "")
    page.fill("#f-reason", "INJECTED")
    page.click("#jobs-search")
    expect(rows).to_have_count(3)

    # Keyboard: Enter on a focused row opens the job view; its lane shows every hand-off.
    page.locator(f'#job-list tr[data-job-id="{stack.quarantined[0]}"]').focus()
    page.keyboard.press("Enter")
    expect(page.locator("#job-state")).to_have_text("quarantined")
    page.fill("#job-id", stack.succeeded[0])
    page.click("#show-job")
    expect(page.locator("#job-state")).to_have_text("succeeded")
    for stage in ("accepted", "published", "claimed", "result_saved", "ack_sent"):
        expect(page.locator(f'#lane [data-stage="{stage}"]')).to_have_class("stage reached")
    expect(page.locator("#lane .gap")).to_have_count(4)
    expect(page.locator("#attempts tbody td.duration")).not_to_have_text("-")
    expect(page.locator("#attempts th.worker")).to_be_visible()
    assert errors == []

    SHOTS.mkdir(parents=True, exist_ok=True)
    for width in (1280, 390):
        for scheme in ("light", "dark"):
            shot, shot_errors = open_console(
                browser,
                stack,
                stack.admin,
                viewport={"width": width, "height": 900},
                color_scheme=scheme,
            )
            expect(shot.locator("#overview")).to_have_attribute("data-loaded", "true")
            expect(shot.locator("#job-list tbody tr")).to_have_count(7)
            shot.fill("#job-id", stack.succeeded[0])
            shot.click("#show-job")
            expect(shot.locator("#job-state")).to_have_text("succeeded")
            for view in VIEWS:
                path = SHOTS / f"{view}-{width}-{scheme}.png"
                shot.locator(f"#{view}").screenshot(path=str(path))
                assert path.stat().st_size > 5_000, path
            # Nothing wider than the window: every view is usable at this width.
            overflow = shot.evaluate("document.documentElement.scrollWidth")
            assert overflow <= width, (width, overflow)
            assert shot_errors == []
            shot.context.close()


def test_state_cards_and_type_and_queue_rows_open_the_filtered_list(
    browser: Any,  # noqa: F811
    stack: Stack,
) -> None:
    from playwright.sync_api import expect

    page, errors = open_console(browser, stack, stack.admin, viewport=WIDE)
    expect(page.locator("#overview")).to_have_attribute("data-loaded", "true")
    rows = page.locator("#job-list tbody tr")
    expect(rows).to_have_count(7)

    page.click('#state-counts a[data-state="quarantined"]')
    expect(page).to_have_url(f"{stack.base}/console#jobs?state=quarantined")
    expect(page.locator("#f-state")).to_have_value("quarantined")
    expect(rows).to_have_count(3)
    expect(page.locator('#job-list tr[data-state="quarantined"]')).to_have_count(3)

    page.click('#type-counts tr[data-name="report.export"] a')
    expect(page).to_have_url(f"{stack.base}/console#jobs?type=report.export")
    expect(page.locator("#f-type")).to_have_value("report.export")
    expect(page.locator("#f-state")).to_have_value("")  # the address is the whole filter
    expect(rows).to_have_count(7)

    page.click('#queue-counts tr[data-name="default"] a')
    expect(page.locator("#f-queue")).to_have_value("default")
    expect(page.locator("#f-type")).to_have_value("")
    expect(rows).to_have_count(7)

    # The address alone, as a bookmark: read when the page loads (the tab keeps the token).
    page.goto(f"{stack.base}/console#jobs?state=succeeded&accountId=globex")
    page.reload()
    expect(page.locator("#whoami")).to_have_text("admin token")
    expect(page.locator("#f-state")).to_have_value("succeeded")
    expect(page.locator("#f-account")).to_have_value("globex")
    expect(rows).to_have_count(1)
    # The params column: the job's own params as JSON, all of them on hover.
    params = page.locator(f'#job-list tr[data-job-id="{stack.globex}"] td.params')
    expect(params).to_have_text('{"accountId": "globex", "period": "2020-07"}')
    expect(params).to_have_attribute("title", '{"accountId": "globex", "period": "2020-07"}')

    # A search from the form is kept in the address too, and the Jobs link lists them all.
    page.select_option("#f-state", "quarantined")
    page.fill("#f-account", "")
    page.click("#jobs-search")
    expect(page).to_have_url(f"{stack.base}/console#jobs?state=quarantined")
    expect(rows).to_have_count(3)
    page.click('nav a[href="#jobs"]')
    expect(page.locator("#f-state")).to_have_value("")
    expect(rows).to_have_count(7)
    assert errors == []
    page.context.close()


def test_an_account_token_sees_only_its_own_jobs_and_no_operator_details(
    browser: Any,  # noqa: F811
    stack: Stack,
) -> None:
    from playwright.sync_api import expect

    page, errors = open_console(browser, stack, stack.acme, viewport=WIDE)
    expect(page.locator("#whoami")).to_have_text("token for account acme")
    rows = page.locator("#job-list tbody tr")
    expect(rows).to_have_count(6)
    expect(page.locator(f'#job-list tr[data-job-id="{stack.globex}"]')).to_have_count(0)
    expect(page.locator("#overview-note")).to_be_visible()
    expect(page.locator("#overview-body")).to_be_hidden()
    expect(page.locator("#bulk")).to_be_hidden()
    expect(page.locator("#queues-body")).to_be_hidden()
    page.fill("#job-id", stack.globex)
    page.click("#show-job")
    expect(page.locator("#message")).to_contain_text("no job")
    page.fill("#job-id", stack.succeeded[0])
    page.click("#show-job")
    expect(page.locator("#job-state")).to_have_text("succeeded")
    expect(page.locator("#attempts th.worker")).to_be_hidden()
    text = page.locator("main").inner_text()
    assert socket.gethostname() not in text  # no worker or relay host anywhere
    assert "token#" not in text and "support-console" not in text
    assert errors == []
    page.context.close()


def test_pausing_a_queue_stops_deliveries_and_resuming_drains_them(
    browser: Any,  # noqa: F811
    stack: Stack,
) -> None:
    from playwright.sync_api import expect

    page, errors = open_console(browser, stack, stack.admin, viewport=WIDE)
    row = page.locator('#queue-list tr[data-queue="default"]')
    expect(row).to_contain_text("consuming")
    page.fill("#queue-reason", "deploying the exporter")
    row.locator("button.queue-toggle").click()
    expect(row).to_have_attribute("data-paused", "true")
    expect(row).to_contain_text("deploying the exporter")
    poll(lambda: '"queue_paused"' in stack.up.log(), 30, "the worker to leave the queue")

    held = [submit(stack.base, stack.acme, "acme", f"2021-0{i}") for i in range(1, 4)]
    poll(lambda: all(stack.show(j)["published"] for j in held), 30, "the publishes")
    page.click("#refresh-overview")
    expect(row.locator("td").nth(0)).to_have_text("3")  # ready in the local queue
    for job_id in held:
        doc = stack.show(job_id)
        assert doc["state"] == "queued" and doc["attempt"] == 0, doc
        assert "claimed" not in [e["kind"] for e in doc["events"]]

    page.fill("#queue-reason", "exporter deployed")
    row.locator("button.queue-toggle").click()
    expect(row).to_have_attribute("data-paused", "false")
    for job_id in held:
        doc = poll(
            lambda j=job_id: (d := stack.show(j))["state"] == "succeeded" and d,
            60,
            "the held jobs to succeed",
        )
        assert doc["attempt"] == 1
        assert [e["kind"] for e in doc["events"]].count("result_saved") == 1
    assert errors == []
    page.context.close()


def test_bulk_replay_of_quarantined_jobs_by_reason_runs_to_the_end(
    browser: Any,  # noqa: F811
    stack: Stack,
) -> None:
    from playwright.sync_api import expect

    page, errors = open_console(browser, stack, stack.admin, viewport=WIDE)
    expect(page.locator("#bulk")).to_be_visible()
    page.select_option("#f-state", "quarantined")
    page.fill("#f-reason", "injected")
    page.click("#jobs-search")
    expect(page.locator("#job-list tbody tr")).to_have_count(3)
    page.click("#bulk-count")
    expect(page.locator("#bulk-status")).to_contain_text("give a reason")
    page.fill("#bulk-reason", "exporter fixed")
    page.click("#bulk-count")
    expect(page.locator("#bulk-status")).to_contain_text("Dry run: 3 job(s) match")
    assert all(stack.show(j)["state"] == "quarantined" for j in stack.quarantined)
    page.click("#bulk-run")
    expect(page.locator("#bulk-status")).to_contain_text(
        "replay finished: 3 done, 0 refused, 0 remaining"
    )
    expect(page.locator("#bulk-progress")).to_have_attribute("value", "3")
    expect(page.locator("#jobs-note")).to_contain_text("No jobs match")
    page.screenshot(path=str(SHOTS / "bulk-replay-1280-light.png"), full_page=True)
    for job_id in stack.quarantined:
        doc = poll(
            lambda j=job_id: (d := stack.show(j))["state"] == "succeeded" and d,
            60,
            "the replayed jobs to succeed",
        )
        [replayed] = [e for e in doc["events"] if e["kind"] == "replayed"]
        assert replayed["detail"]["reason"] == "exporter fixed"
        assert replayed["detail"]["actor"].startswith("token#")
        assert replayed["detail"]["actor"].endswith("(support-console)")
    assert errors == []
    page.context.close()


def test_at_390_px_nothing_runs_past_the_edge_ids_copy_whole_and_gone_processes_show(
    browser: Any,  # noqa: F811
    stack: Stack,
    tmp_path: Any,
) -> None:
    from playwright.sync_api import expect

    address = "accounts-payable.quarterly-reports@acme.example"  # params past 60 characters
    response = httpx.post(
        f"{stack.base}/v1/exports",
        json={"accountId": "acme", "period": RETRIED, "notifyEmail": address},
        headers={"Authorization": f"Bearer {stack.acme}"},
        timeout=10,
    )
    assert response.status_code == 202, response.text
    retried = str(response.json()["jobId"])
    doc = poll(
        lambda: (d := stack.show(retried))["state"] == "retry_wait" and d, 60, "the retry_wait"
    )
    # A second worker that dies without a word (kill -9): its heartbeat row stays behind.
    with processes(tmp_path) as start:
        extra = start("worker", "worker", env=stack.env)
        poll(lambda: extra.pid in {p["pid"] for p in overview(stack)["processes"]}, 60, "its beat")
        extra.kill9()
    poll(
        lambda: (
            [p["status"] for p in overview(stack)["processes"] if p["pid"] == extra.pid] == ["gone"]
        ),
        60,
        "the killed worker to be marked gone",
    )

    page, errors = open_console(
        browser,
        stack,
        stack.admin,
        viewport=PHONE,
        permissions=["clipboard-read", "clipboard-write"],
    )
    expect(page.locator("#overview")).to_have_attribute("data-loaded", "true")
    gone = page.locator(f'#process-list tr[data-status="gone"]:has(td:text-is("{extra.pid}"))')
    expect(gone).to_have_class("gone")
    expect(gone.locator("td.last-seen")).to_contain_text("gone since")
    expect(page.locator('#process-list tr[data-role="worker"][data-status="alive"]')).to_have_count(
        1
    )

    # The retry_wait card lists the waiting job, with its next attempt in words.
    page.click('#state-counts a[data-state="retry_wait"]')
    row = page.locator(f'#job-list tr[data-job-id="{retried}"]')
    expect(row.locator(".next-attempt")).to_contain_text("next attempt in")
    shown = row.locator(".next-attempt").get_attribute("datetime")
    assert shown and parse_time(shown) == parse_time(doc["nextAttemptAt"])
    # Long params are cut, with all of them on hover.
    params = row.locator("td.params")
    full = f'{{"accountId": "acme", "period": "{RETRIED}", "notifyEmail": "{address}"}}'
    expect(params).to_have_attribute("title", full)
    expect(params).to_have_text(full[:59] + "…")
    # Its id shortened to its last 8 characters; the button copies the whole id.
    expect(row.locator(".job-id a")).to_have_text("…" + retried[-8:])
    expect(row.locator(".job-id a")).to_have_attribute("title", retried)
    row.locator("button.copy-id").click()
    expect(row.locator("button.copy-id")).to_have_attribute("data-copied", retried)
    assert page.evaluate("navigator.clipboard.readText()") == retried

    views = {
        "overview": "#overview",
        "jobs": "#jobs?state=retry_wait",
        "queues": "#queues",
        "quarantine": "#quarantine",
        "schedules": "#schedules",
    }
    for view, address in views.items():
        page.goto(f"{stack.base}/console{address}")
        expect(page.locator(f"#{view}")).to_be_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"], view
        assert overflowing(page, PHONE["width"]) == [], view
    # The job view, reached from the list's shortened id; its copy button copies the whole id.
    page.locator(f'#job-list tr[data-job-id="{retried}"] .job-id a').click()
    expect(page.locator("#job-state")).to_have_text("retry_wait")
    page.click("#copy-job-id")
    expect(page.locator("#copy-job-id")).to_have_attribute("data-copied", retried)
    assert page.evaluate("navigator.clipboard.readText()") == retried
    assert overflowing(page, PHONE["width"]) == [], "job view"
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    page.locator("#lookup").screenshot(path=str(SHOTS / "job-retry-wait-390-light.png"))
    assert errors == []
    page.context.close()


def parse_time(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def overview(stack: Stack) -> dict[str, Any]:
    response = httpx.get(
        f"{stack.base}/v1/overview",
        headers={"Authorization": f"Bearer {stack.admin}"},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())
