"""``jobrelay demo``: the whole route, end to end, on whatever is configured (embedded default).

It migrates, seeds, creates a token, starts api + relay + worker in this process, and then
talks to the API over real HTTP like any client would: several exports, a repeated request
(same jobId back), a bad request (422, nothing created), one job that fails transiently
once and one whose payload is invalid, both through armed fault points that the demo
announces. A live table follows the jobs; then each job's timeline and where its CSV is.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from jobrelay.exports.seed import seed_database
from jobrelay.observe.faults import Faults
from jobrelay.processes.api_server import build_server, serve_until
from jobrelay.processes.entry_points import create_token, upgrade_database
from jobrelay.relay.publisher import Relay
from jobrelay.runtime.wiring import open_runtime
from jobrelay.settings import Settings, redact_url
from jobrelay.worker.consumer import Worker

console = Console(highlight=False)

REQUESTS: list[tuple[str, str, str]] = [
    ("acme", "2020-05", "ordinary export"),
    ("globex", "2021-01", "ordinary export"),
    ("initech", "2019-12", "ordinary export"),
    ("acme", "2020-02", "fails transiently once, then succeeds"),
    ("globex", "2019-07", "invalid payload: ends quarantined"),
]
DEMO_FAULTS = (
    "export.run:transient:1@accountId=acme&period=2020-02,"
    "export.run:invalid@accountId=globex&period=2019-07"
)
TERMINAL = {"succeeded", "quarantined", "cancelled"}
DEMO_ROWS_PER_MONTH = 2000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run_demo(settings: Settings, *, timeout: float = 120.0) -> int:
    console.rule("[bold]jobrelay demo")
    console.print(f"database  {redact_url(settings.database_url)}")
    console.print(f"broker    {redact_url(settings.broker_url)}")
    console.print(f"results   {settings.results_url}")
    revision = await upgrade_database(settings)
    console.print(f"schema    at revision {revision}")
    # The demo's own data, whatever was there: it is the demo's database.
    counts = (await seed_database(settings.database_url, DEMO_ROWS_PER_MONTH, replace=True)).counts
    console.print(f"seeded    {sum(counts.values())} ledger rows for {', '.join(counts)}")
    token = await create_token(settings, None, True, "demo")
    console.print(f"[yellow]faults    armed on purpose for two demo jobs: {DEMO_FAULTS}[/yellow]")

    port = _free_port()
    stop = asyncio.Event()
    async with open_runtime(settings, faults=Faults(DEMO_FAULTS)) as rt:
        server = build_server(rt, "127.0.0.1", port)
        tasks = [
            asyncio.create_task(serve_until(server, stop)),
            asyncio.create_task(Relay(rt).run(stop)),
            asyncio.create_task(Worker(rt).run(stop)),
        ]
        try:
            await _until_serving(server, tasks[0])
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(
                base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=10
            ) as client:
                jobs = await _submit_all(client)
                ok = await _follow(client, jobs, timeout)
                await _report(client, rt.results, jobs)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    _print_try_it(token)
    return 0 if ok else 1


async def _until_serving(server: Any, serving: asyncio.Task[None]) -> None:
    """uvicorn exposes only a ``started`` flag, so poll it, bounded, watching for failure."""
    deadline = time.monotonic() + 30
    while not server.started:
        if serving.done() or time.monotonic() > deadline:
            raise SystemExit("jobrelay: error: the demo's HTTP server did not start")
        await asyncio.sleep(0.02)


async def _submit_all(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    run = uuid.uuid4().hex[:8]
    jobs = []
    for i, (account, period, note) in enumerate(REQUESTS):
        response = await client.post(
            "/v1/exports",
            json={"accountId": account, "period": period},
            headers={"Idempotency-Key": f"demo-{run}-{i}"},
        )
        response.raise_for_status()
        body = response.json()
        console.print(
            f"POST /v1/exports {account} {period} -> {response.status_code} "
            f"jobId={body['jobId']}  ({note})"
        )
        jobs.append({"jobId": body["jobId"], "account": account, "period": period, "note": note})
    again = await client.post(
        "/v1/exports",
        json={"accountId": "acme", "period": "2020-05"},
        headers={"Idempotency-Key": f"demo-{run}-0"},
    )
    same = again.json().get("jobId") == jobs[0]["jobId"]
    console.print(
        f"POST again with the same Idempotency-Key -> {again.status_code}, "
        f"{'same jobId, nothing new created' if same else 'DIFFERENT jobId (bug)'}"
    )
    bad = await client.post("/v1/exports", json={"accountId": "acme", "period": "2020-13"})
    console.print(
        f"POST with period 2020-13 -> {bad.status_code} "
        f"{bad.headers.get('content-type')}: {bad.json().get('detail')}"
    )
    return jobs


def _table(states: dict[str, dict[str, Any]], jobs: list[dict[str, Any]]) -> Table:
    table = Table(title="jobs (live)", show_edge=False)
    for column in (
        "job",
        "account",
        "period",
        "state",
        "published",
        "attempt",
        "progress",
        "last error",
    ):
        table.add_column(column)
    for job in jobs:
        s = states.get(job["jobId"], {})
        progress = s.get("progress") or {}
        table.add_row(
            job["jobId"][:8],
            job["account"],
            job["period"],
            s.get("state", "?"),
            "yes" if s.get("published") else "no",
            f"{s.get('attempt', 0)}/{s.get('maxAttempts', '?')}",
            f"{progress.get('done', 0)}/{progress.get('total', '?')}" if progress else "-",
            (s.get("lastError") or "")[:50],
        )
    return table


async def _follow(client: httpx.AsyncClient, jobs: list[dict[str, Any]], timeout: float) -> bool:
    states: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    finished = False
    with Live(_table(states, jobs), console=console, refresh_per_second=8) as live:
        while time.monotonic() < deadline:
            for job in jobs:
                states[job["jobId"]] = (await client.get(f"/v1/jobs/{job['jobId']}")).json()
            live.update(_table(states, jobs))
            if all(states[j["jobId"]].get("state") in TERMINAL for j in jobs) and all(
                [await _settled(client, j["jobId"]) for j in jobs]
            ):
                finished = True
                break
            await asyncio.sleep(0.2)
    console.print()  # rich leaves the cursor on the table's last line when not on a terminal
    if not finished:
        console.print(f"[red]not all jobs finished within {timeout:.0f} s[/red]")
    return finished


async def _settled(client: httpx.AsyncClient, job_id: str) -> bool:
    """The ack or reject is recorded just after the broker has it: wait, so timelines are whole."""
    events = (await client.get(f"/v1/jobs/{job_id}/events")).json()["events"]
    kinds = [e["kind"] for e in events if e["kind"] != "published"]
    return bool(kinds) and kinds[-1] in ("ack_sent", "rejected", "settle_lost")


async def _report(client: httpx.AsyncClient, results: Any, jobs: list[dict[str, Any]]) -> None:
    for job in jobs:
        state = (await client.get(f"/v1/jobs/{job['jobId']}")).json()
        events = (await client.get(f"/v1/jobs/{job['jobId']}/events")).json()["events"]
        console.rule(f"{job['jobId']}  {job['account']} {job['period']}  [bold]{state['state']}")
        for event in events:
            shown = {**event["detail"], **event["detail"].get("meta", {})}  # meta flattened
            hidden = ("sha256", "meta")
            detail = ", ".join(
                f"{k}={v}" for k, v in shown.items() if v is not None and k not in hidden
            )
            console.print(f"  {event['at']}  {event['kind']:<16} {detail}")
        if state["state"] == "succeeded":
            console.print(f"  CSV: {results.describe(state['resultKey'])}")
        elif state.get("lastError"):
            console.print(f"  reason: {state['lastError']}")


def _print_try_it(token: str) -> None:
    console.rule("try it by hand")
    console.print("Start the pipeline:   .venv/bin/jobrelay up     (serves 127.0.0.1:8000)")
    console.print("Then, in another terminal:")
    console.print(f"  TOKEN={token}")
    console.print(
        '  curl -s -X POST localhost:8000/v1/exports -H "Authorization: Bearer $TOKEN" '
        "-H 'Content-Type: application/json' "
        '-d \'{"accountId": "acme", "period": "2021-03"}\''
    )
    console.print('  curl -s localhost:8000/v1/jobs/<jobId> -H "Authorization: Bearer $TOKEN"')
    console.print(
        '  curl -s localhost:8000/v1/jobs/<jobId>/events -H "Authorization: Bearer $TOKEN"'
    )
    console.print(
        '  curl -s localhost:8000/v1/jobs/<jobId>/result -H "Authorization: Bearer $TOKEN"'
    )
    console.print("  .venv/bin/jobrelay job show <jobId>")


def demo_main(settings: Settings) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(run_demo(settings))
    return 130
