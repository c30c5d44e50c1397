"""The console's schedules section in headless Chromium, on real data.

``jobrelay up --app`` runs an app with a one-second schedule; once it has enqueued ticks, an
admin sees the schedule in the console with its cron, next tick, and its last tick's job
(a link that opens the job) and state, pauses it from the page with a reason, and resumes
it; the schedule's timeline then holds both actions naming the admin token. An account
token sees no schedules.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from .procs import FAST_ENV, clean_env, free_port, poll, processes, run_cli, wait_http
from .test_console import TIMEOUT_MS, browser, overflowing  # noqa: F401 (the module's browser)
from .test_schedules import NAME, count_at_least, write_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def cli_ok(*args: str, env: dict[str, str], cwd: Path) -> str:
    result = run_cli(*args, env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_console_lists_pauses_and_resumes_a_schedule(browser: Any, tmp_path: Path) -> None:  # noqa: F811
    from playwright.sync_api import expect

    root = write_app(tmp_path / "outside")
    url = f"sqlite:///{tmp_path}/jr.db"
    env = clean_env(
        JOBRELAY_DATABASE_URL=url,
        JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports",
        JOBRELAY_APP="tickapp.jobs:app",
        **FAST_ENV,
    )
    cli_ok("db", "upgrade", env=env, cwd=root)
    admin = cli_ok("token", "create", "--admin", "--label", "ops", env=env, cwd=root)
    admin = admin.strip().splitlines()[-1]
    acme = cli_ok("token", "create", "--account", "acme", env=env, cwd=root)
    acme = acme.strip().splitlines()[-1]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with processes(tmp_path) as start:
        up = start("up", "up", "--port", str(port), env=env, cwd=root)
        wait_http(base, up)
        poll(lambda: count_at_least(url, 2), 60, "two ticks")

        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("dialog", lambda dialog: dialog.accept())
        page.goto(f"{base}/console")
        page.fill("#token", admin)
        page.click("#use-token")
        expect(page.locator("#whoami")).to_have_text("admin token")

        row = page.locator(f'#schedule-list tr[data-schedule="{NAME}"]')
        expect(row).to_contain_text("* * * * * *")
        expect(row).to_have_attribute("data-paused", "false")
        listed = json.loads(cli_ok("schedules", "list", "--json", env=env, cwd=root))
        (shown,) = listed["schedules"]
        assert shown["lastJobId"]
        # The last tick's job is a link that opens it.
        row.locator("a").click()
        expect(page.locator("#job-title")).to_contain_text("beat.second")

        # Pausing needs a reason; then the row says paused.
        row.locator("button.schedule-toggle").click()
        expect(page.locator("#schedules-note")).to_contain_text("give a reason")
        page.fill("#schedule-reason", "night maintenance")
        row.locator("button.schedule-toggle").click()
        expect(page.locator("#schedules-note")).to_contain_text("is paused")
        expect(row).to_have_attribute("data-paused", "true")
        expect(row).to_contain_text("paused by token#")
        page.fill("#schedule-reason", "maintenance over")
        row.locator("button.schedule-toggle").click()
        expect(page.locator("#schedules-note")).to_contain_text("runs again")
        expect(row).to_have_attribute("data-paused", "false")

        # At a phone's 390 px the schedules run past no edge; the last job's id is shortened.
        page.set_viewport_size({"width": 390, "height": 844})
        page.goto(f"{base}/console#schedules")
        link = row.locator(".job-id a")
        expect(link).to_have_text(re.compile(r"^…[0-9a-f]{8}$"))
        whole = link.get_attribute("title") or ""
        assert re.fullmatch(r"[0-9a-f-]{36}", whole) and link.inner_text() == "…" + whole[-8:]
        expect(row.locator("button.copy-id")).to_have_attribute("data-copy", whole)
        assert overflowing(page, 390) == []
        assert page.evaluate("document.documentElement.scrollWidth") <= 390

        page.fill("#token", acme)
        page.click("#use-token")
        expect(page.locator("#schedules-note")).to_contain_text("needs an admin token")
        expect(page.locator("#schedule-list")).to_be_hidden()
        assert errors == []

        timeline = json.loads(cli_ok("schedules", "show", NAME, "--json", env=env, cwd=root))
    kinds = [e["kind"] for e in timeline["events"]]
    assert kinds[0] == "resumed" and "paused" in kinds
    paused = next(e for e in timeline["events"] if e["kind"] == "paused")
    assert paused["detail"]["reason"] == "night maintenance"
    assert paused["detail"]["actor"].endswith("(ops)")
