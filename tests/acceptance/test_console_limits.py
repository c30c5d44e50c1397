"""The console's limits panel in headless Chromium, on real data (issue 36).

``jobrelay up --app`` runs an app whose one job type is under ``ConcurrencyLimit(2)`` per
account, and whose jobs hold their slot until the test lets them finish. Before any job the
panel says no limit is in use. Then 17 jobs: five of an account whose name is an HTML tag
(two run, three wait for admission), one of another and one each of eleven more; an
operator overrides one key's limit from the CLI with a reason that is markup too. The panel
shows the limit's totals, its ten keys with the most waiting, the other three counted, the
override and its reason, and the hostile key and reason as text: no element is made of
them and no script of theirs runs. From the panel an admin overrides the hostile key's
limit (a reason required; a bad value refused by the server and shown), the relay admits one
more of its jobs, and clears it; the audit names the token. At 390 px nothing runs past the
edge; an account token sees no limits.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

from .procs import FAST_ENV, clean_env, free_port, poll, processes, run_cli, wait_http
from .test_console import ARTIFACTS, TIMEOUT_MS, browser, overflowing  # noqa: F401
from .test_library_app import sql_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
HOSTILE = "<img src=x onerror=alert(1)>"
REASON = "<b>vip</b> customer"
OTHERS = [f"k{i:02d}" for i in range(11)]
JOBS = """
import asyncio
import os

import jobrelay
from pydantic import BaseModel

app = jobrelay.App()


class Hold(BaseModel):
    account: str
    n: int = 0


@app.job("lab.hold", params=Hold, limits=[jobrelay.ConcurrencyLimit(2, key=lambda p: p.account)])
async def hold(ctx: jobrelay.JobContext[Hold], params: Hold) -> None:
    # Holds its slot until the test is done with the page (it writes the file).
    while not os.path.exists(os.environ["LIMITAPP_RELEASE"]):
        await asyncio.sleep(0.05)
"""
CLIENT = """
import json
import sys

from sqlalchemy import create_engine

from limitapp.jobs import app, hold

engine = create_engine(app.settings.database_url)
with engine.begin() as conn:
    for account, n in json.loads(sys.argv[1]):
        for i in range(n):
            hold.enqueue_sync(conn, {"account": account, "n": i})
engine.dispose()
"""


def write_app(root: Path) -> Path:
    pkg = root / "limitapp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "jobs.py").write_text(textwrap.dedent(JOBS))
    (pkg / "client.py").write_text(textwrap.dedent(CLIENT))
    return root


def cli_ok(*args: str, env: dict[str, str], cwd: Path) -> str:
    result = run_cli(*args, env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_console_limits_panel_shows_a_limits_keys_and_escapes_them(
    browser: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    from playwright.sync_api import expect

    root = write_app(tmp_path / "outside")
    release = tmp_path / "release"
    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/jr.db",
        JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports",
        JOBRELAY_APP="limitapp.jobs:app",
        LIMITAPP_RELEASE=str(release),
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
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            dialogs: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.accept()))
            page.goto(f"{base}/console")
            page.fill("#token", admin)
            page.click("#use-token")
            expect(page.locator("#whoami")).to_have_text("admin token")
            # No job under a limit yet: the panel says so, and shows no table.
            expect(page.locator("#limits-note")).to_contain_text("No limits in use")
            expect(page.locator("#limit-list")).to_be_hidden()

            accounts = [(HOSTILE, 5), ("globex", 1)] + [(k, 1) for k in OTHERS]
            enqueue = [sys.executable, "-m", "limitapp.client", json.dumps(accounts)]
            done = subprocess.run(
                enqueue, env=env, cwd=root, capture_output=True, text=True, timeout=60, check=False
            )
            assert done.returncode == 0, done.stderr

            def settled() -> bool:
                response = httpx.get(
                    f"{base}/v1/limits",
                    headers={"Authorization": f"Bearer {admin}"},
                    timeout=5,
                )
                groups = response.json()["groups"]
                return bool(groups) and (groups[0]["running"], groups[0]["waiting"]) == (14, 3)

            poll(settled, 60, "14 jobs admitted and 3 waiting")
            args = ("--key", "globex", "--concurrency", "3", "--reason", REASON, "--actor", "alice")
            cli_ok("limits", "set", "lab.hold", *args, env=env, cwd=root)

            page.click("#refresh-limits")
            group = page.locator('#limit-list tbody[data-limit="lab.hold"]')
            total = group.locator("tr.limit-total")
            expect(total).to_contain_text("concurrency, 13 keys")
            expect(total.locator("td.running")).to_have_text("14")
            expect(total.locator("td.waiting")).to_have_text("3")
            expect(total.locator("td.reason")).to_have_text("2")
            hot = group.locator("tr.limit-key").first
            expect(hot).to_have_attribute("data-key", HOSTILE)
            expect(hot.locator("th.key")).to_have_text(HOSTILE)
            expect(hot.locator("td.running")).to_have_text("2")
            expect(hot.locator("td.waiting")).to_have_text("3")
            expect(hot.locator("td.age")).not_to_have_text("-")
            assert group.locator("tr.limit-key").count() == 10
            globex = group.locator('tr[data-key="globex"]')
            expect(globex.locator("td.reason")).to_have_text(f"3 (override by alice: {REASON})")
            expect(group.locator("tr.limit-rest")).to_contain_text("and 3 more keys")
            expect(group.locator("tr.limit-rest td.running")).to_have_text("3")
            # The key and the reason are text: no element was made of them, no script ran.
            assert page.locator("#limits img, #limits b").count() == 0
            assert dialogs == [] and errors == []
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator("#limits").screenshot(path=str(ARTIFACTS / "console-limits.png"))

            # An override from the panel: the row fills the form; a reason is required; the
            # server's refusal is shown; set, the relay admits one more of the key; cleared.
            status = page.locator("#override-status")
            hot.locator("button.override-pick").click()
            expect(page.locator("#override-name")).to_have_value("lab.hold")
            expect(page.locator("#override-key")).to_have_value(HOSTILE)
            expect(page.locator("#override-concurrency")).to_have_value("2")
            page.fill("#override-concurrency", "3")
            page.click("#override-set")
            expect(status).to_contain_text("give a reason")
            page.fill("#override-reason", "orders backlog")
            page.fill("#override-rate", "1/second")
            page.click("#override-set")
            expect(status).to_contain_text("override refused: ")
            expect(status).to_contain_text("exactly one of concurrency and rate")
            page.fill("#override-rate", "")
            page.click("#override-set")
            expect(status).to_contain_text("overridden: 3 from the relay's next round")
            poll(lambda: hostile_row(base, admin) == (3, 2), 30, "a third slot for the key")
            page.click("#refresh-limits")
            hot = group.locator(f'tr[data-key="{HOSTILE}"]')
            expect(hot.locator("td.running")).to_have_text("3")
            expect(hot.locator("td.reason")).to_have_text(
                re.compile(r"^3 \(override by token#\d+ \(ops\): orders backlog\)$")
            )
            hot.locator("button.override-pick").click()
            page.click("#override-clear")
            expect(status).to_contain_text("give a reason")
            page.fill("#override-reason", "backlog gone")
            page.click("#override-clear")
            expect(status).to_contain_text("cleared")
            expect(hot.locator("td.reason")).to_have_text("2")
            assert page.locator("#limits img, #limits b").count() == 0
            assert dialogs == [
                f"override limit lab.hold key {HOSTILE}?",  # the one the server refused
                f"override limit lab.hold key {HOSTILE}?",
                f"clear the override of limit lab.hold key {HOSTILE}?",
            ]
            dialogs.clear()

            page.set_viewport_size({"width": 390, "height": 844})
            page.goto(f"{base}/console#limits")
            expect(page.locator("#limit-list tr.limit-key").first).to_have_attribute(
                "data-key", HOSTILE
            )
            assert overflowing(page, 390) == []
            assert page.evaluate("document.documentElement.scrollWidth") <= 390

            page.fill("#token", acme)
            page.click("#use-token")
            expect(page.locator("#limits-note")).to_contain_text("need an admin token")
            expect(page.locator("#limit-list")).to_be_hidden()
            assert dialogs == [] and errors == []
        finally:
            release.write_text("done")
    audit = sql_rows(
        f"sqlite:///{tmp_path}/jr.db",
        "SELECT kind, actor, reason FROM limit_events WHERE limit_id = :i ORDER BY id",
        i=f"lab.hold\x1f{HOSTILE}",
    )
    assert [(kind, reason) for kind, _, reason in audit] == [
        ("set", "orders backlog"),
        ("cleared", "backlog gone"),
    ]
    assert all(re.fullmatch(r"token#\d+ \(ops\)", actor) for _, actor, _ in audit), audit


def hostile_row(base: str, admin: str) -> tuple[int, int] | None:
    response = httpx.get(
        f"{base}/v1/limits",
        params={"top": 1},
        headers={"Authorization": f"Bearer {admin}"},
        timeout=5,
    )
    [row] = response.json()["limits"]
    return (row["running"], row["waiting"]) if row["key"] == HOSTILE else None
