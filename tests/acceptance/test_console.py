"""The support console in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

A ``jobrelay up`` process on SQLite serves the console; one job succeeds and one is
quarantined by an injected fault on its first attempt. Through the page, an admin looks the
first up, finds the second in the quarantined list with its reason, opens the collapsed
traceback of its failure, and replays it; the database then shows the ``replayed`` event
naming the admin token. An account token sees no admin controls and no traceback. A
screenshot is saved under test-artifacts/ for the CI run.

With ``JOBRELAY_REQUIRE_SERVICES=1`` (CI) a missing browser or Playwright fails the test;
otherwise it is skipped with the reason. ``.ci/run`` installs the browser.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .procs import FAST_ENV, clean_env, free_port, poll, processes, run_cli, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
CHROMIUM = os.environ.get("JOBRELAY_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).parents[2] / "test-artifacts"
TIMEOUT_MS = 15_000


def _unavailable(reason: str) -> None:
    message = f"headless Chromium unavailable: {reason}"
    if os.environ.get("JOBRELAY_REQUIRE_SERVICES") == "1":
        pytest.fail(message + " (JOBRELAY_REQUIRE_SERVICES=1; .ci/run installs it)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        _unavailable(f"{CHROMIUM} not found (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        _unavailable(f"the playwright package is not installed ({exc})")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def overflowing(page: Any, width: int) -> list[str]:
    """The visible elements whose right edge is past ``width``, other than those inside a box
    that clips or scrolls them (a table's ``.scroll``, the chart's box)."""
    return list(
        page.evaluate(
            """(width) => {
              const clipped = (node) => {
                let up = node.parentElement;
                for (; up && up !== document.body; up = up.parentElement) {
                  if (getComputedStyle(up).overflowX !== "visible") return true;
                }
                return false;
              };
              const out = [];
              for (const node of document.querySelectorAll("body *")) {
                const box = node.getBoundingClientRect();
                if (box.width === 0 || box.height === 0 || box.right <= width + 0.5) continue;
                if (!clipped(node)) out.push(node.tagName + "#" + node.id + "." + node.className);
              }
              return out;
            }""",
            width,
        )
    )


def cli_ok(*args: str, env: dict[str, str]) -> str:
    result = run_cli(*args, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def show(env: dict[str, str], job_id: str) -> dict[str, Any]:
    return dict(json.loads(cli_ok("job", "show", job_id, "--json", env=env)))


def test_console_looks_up_and_replays(browser: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/jr.db",
        JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports",
        **FAST_ENV,
    )
    cli_ok("db", "upgrade", env=env)
    cli_ok("seed", "--rows-per-month", "20", env=env)
    admin = cli_ok("token", "create", "--admin", "--label", "support-console", env=env)
    admin = admin.strip().splitlines()[-1]
    acme = cli_ok("token", "create", "--account", "acme", env=env).strip().splitlines()[-1]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    faults = "export.run:invalid:1@period=2020-01"
    with processes(tmp_path) as start:
        up = start("up", "up", "--port", str(port), env={**env, "JOBRELAY_FAULTS": faults})
        wait_http(base, up)
        ids = {}
        for period in ("2020-01", "2020-02"):
            response = httpx.post(
                f"{base}/v1/exports",
                json={"accountId": "acme", "period": period},
                headers={"Authorization": f"Bearer {acme}"},
                timeout=10,
            )
            ids[period] = response.json()["jobId"]
        quarantined, succeeded = ids["2020-01"], ids["2020-02"]
        poll(lambda: show(env, quarantined)["state"] == "quarantined", 60, "the quarantine")
        poll(lambda: show(env, succeeded)["state"] == "succeeded", 60, "the success")

        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("dialog", lambda dialog: dialog.accept())
        page.goto(f"{base}/console")

        # An admin token: look the succeeded job up.
        page.fill("#token", admin)
        page.click("#use-token")
        expect(page.locator("#whoami")).to_have_text("admin token")
        page.fill("#job-id", succeeded)
        page.click("#show-job")
        expect(page.locator("#job-state")).to_have_text("succeeded")
        expect(page.locator("#next-step")).to_contain_text("done: result at exports/acme/")
        expect(page.locator('#timeline tr[data-kind="result_saved"]')).to_have_count(1)
        expect(page.locator("#replay")).to_be_hidden()
        expect(page.locator("#traceback")).to_be_hidden()  # it never failed

        # The quarantined list shows the other job with its reason; replay it from the page.
        row = page.locator(f'#quarantined tr[data-job-id="{quarantined}"]')
        expect(row).to_contain_text("injected invalid")
        row.locator("a").click()
        expect(page.locator("#job-state")).to_have_text("quarantined")
        # Where its attempt raised, for the admin: collapsed until opened.
        traceback = page.locator("#traceback")
        expect(traceback).to_be_visible()
        expect(traceback).not_to_have_attribute("open", "")
        expect(page.locator("#traceback-text")).to_be_hidden()
        traceback.locator("summary").click()
        expect(page.locator("#traceback-text")).to_contain_text("injected invalid payload")
        page.fill("#action-reason", "fault removed")
        page.click("#replay")
        expect(page.locator("#message")).to_contain_text("is now queued (was quarantined)")
        expect(page.locator(f'#quarantined tr[data-job-id="{quarantined}"]')).to_have_count(0)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "console.png"), full_page=True)

        # An account token sees its jobs but no admin controls.
        page.fill("#token", acme)
        page.click("#use-token")
        expect(page.locator("#whoami")).to_have_text("token for account acme")
        expect(page.locator("#quarantine-note")).to_contain_text("needs an admin token")
        page.fill("#job-id", quarantined)
        page.click("#show-job")
        expect(page.locator("#job-title")).to_contain_text(quarantined)
        expect(page.locator("#traceback")).to_be_hidden()  # operators' only
        expect(page.locator("#replay")).to_be_hidden()
        expect(page.locator("#cancel")).to_be_hidden()
        assert errors == []

        done = poll(
            lambda: (doc := show(env, quarantined))["state"] == "succeeded" and doc,
            60,
            "the replayed job to succeed",
        )
    replayed = next(e for e in done["events"] if e["kind"] == "replayed")
    assert replayed["detail"]["reason"] == "fault removed"
    assert replayed["detail"]["actor"].endswith("(support-console)")
    assert (ARTIFACTS / "console.png").stat().st_size > 10_000


# Three exports enqueued through the library without a key: UUIDv7 ids, made within the
# same few milliseconds, so they share their first 8 characters (the creation time).
ENQUEUE_V7 = """
import asyncio, json
from jobrelay.exports.shipped import app

async def main():
    ids = [
        await app.enqueue("report.export", {"accountId": "acme", "period": p}, account="acme")
        for p in ("2020-04", "2020-05", "2020-06")
    ]
    await app.aclose()
    print(json.dumps(ids))

asyncio.run(main())
"""


def test_a_job_link_opens_in_a_fresh_tab_and_short_ids_tell_jobs_apart(
    browser: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/jr.db",
        JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports",
        **FAST_ENV,
    )
    cli_ok("db", "upgrade", env=env)
    cli_ok("seed", "--rows-per-month", "20", env=env)
    admin = cli_ok("token", "create", "--admin", env=env).strip().splitlines()[-1]
    made = subprocess.run(
        [sys.executable, "-c", ENQUEUE_V7], env=env, capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    ids: list[str] = json.loads(made.stdout.strip().splitlines()[-1])
    assert len({i[:8] for i in ids}) < len(ids), ids  # what an 8-character prefix showed
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with processes(tmp_path) as start:
        up = start("up", "up", "--port", str(port), env=env)
        wait_http(base, up)
        for job_id in ids:
            poll(lambda j=job_id: show(env, j)["state"] == "succeeded", 60, "a success")

        # A link someone sent, opened in a new tab: no token in its sessionStorage yet. The
        # page asks for one and opens the job once it is pasted.
        page = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{base}/console#job={ids[0]}")
        expect(page.locator("#message")).to_contain_text("paste an API token first")
        expect(page.locator("#job")).to_be_hidden()
        page.fill("#token", admin)
        page.click("#use-token")
        expect(page.locator("#job-title")).to_contain_text(ids[0])
        expect(page.locator("#job-state")).to_have_text("succeeded")
        assert page.url.endswith(f"#job={ids[0]}")
        # Another job's link followed in the same tab, the token already in hand.
        page.goto(f"{base}/console#job={ids[1]}")
        expect(page.locator("#job-title")).to_contain_text(ids[1])

        # The jobs list shows the end of each id, where jobs of the same second differ.
        page.goto(f"{base}/console#jobs")
        shown = []
        for job_id in ids:
            link = page.locator(f'#job-list tr[data-job-id="{job_id}"] .job-id a')
            expect(link).to_have_text("…" + job_id[-8:])
            expect(link).to_have_attribute("title", job_id)
            shown.append(link.inner_text())
        assert len(set(shown)) == len(ids), shown
        assert errors == []
