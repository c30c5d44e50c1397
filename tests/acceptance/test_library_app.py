"""A new user's own app, outside the repository, run through ``--app`` as real processes.

The test writes a throwaway package ``shopapp`` into a temporary directory: its own business
table, two job types (one exposed over HTTP, one on its own queue) and a client that enqueues
inside its own transactions. It then runs it with ``jobrelay up --app`` on the embedded
default, and with ``relay`` + two ``worker --app --queue`` processes on PostgreSQL + RabbitMQ.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import create_engine, text

from .procs import FAST_ENV, clean_env, free_port, poll, processes, run_cli, wait_http

JOBS = """
from __future__ import annotations

import jobrelay
from pydantic import BaseModel, Field
from sqlalchemy import Column, Integer, MetaData, String, Table

app = jobrelay.App()
metadata = MetaData()
orders = Table(
    "shop_orders", metadata, Column("id", Integer, primary_key=True), Column("item", String(64))
)
app.tables(metadata)  # created by `jobrelay db upgrade`, granted by `jobrelay db grant`


class Receipt(BaseModel):
    order_id: int
    email: str = Field(min_length=3)


class Thumb(BaseModel):
    image_id: int
    width: int = Field(gt=0)


@app.job("shop.receipt", params=Receipt, http=True)
async def receipt(ctx: jobrelay.JobContext[Receipt], params: Receipt) -> jobrelay.Result:
    key = ctx.result_key("receipt.txt")
    async with ctx.writer(key) as out:
        await out.write(f"order {params.order_id} for {params.email}".encode())
    return jobrelay.Result(key=key)


@app.job("shop.thumb", params=Thumb, queue="images")
async def thumb(ctx: jobrelay.JobContext[Thumb], params: Thumb) -> None:
    ctx.log.info("thumbnail %s at %s px", params.image_id, params.width)


class Label(BaseModel):
    order_id: int
    path: str


@app.job("shop.label", params=Label)
def label(ctx: jobrelay.SyncJobContext[Label], params: Label) -> jobrelay.Result:
    # A plain def, as a Celery user writes it: runs in the worker's thread pool, once.
    with open(params.path, "a") as effects:
        effects.write(f"{ctx.job_id} {ctx.attempt}\\n")
    ctx.progress(1, 1)
    return jobrelay.Result(meta={"labelled": params.order_id})


@app.job("shop.limited", params=Receipt, retry_delays=(1, 3))
async def limited(ctx: jobrelay.JobContext[Receipt], params: Receipt) -> None:
    if ctx.attempt == 1:
        raise jobrelay.Retry("rate limited", delay=2.5)
"""

CLIENT = """
import asyncio
import json
import sys

import jobrelay
from sqlalchemy import create_engine, insert, make_url, select, func
from sqlalchemy.ext.asyncio import create_async_engine

import os

from shopapp.jobs import app, label, limited, metadata, orders, receipt, thumb

url = make_url(app.settings.database_url)
postgres = url.get_backend_name() == "postgresql"
sync_url = url.set(drivername="postgresql+psycopg") if postgres else url
async_url = (
    url.set(drivername="postgresql+asyncpg")
    if postgres
    else url.set(drivername="sqlite+aiosqlite")
)


async def main() -> dict[str, object]:
    sync_engine = create_engine(sync_url)
    metadata.create_all(sync_engine)
    engine = create_async_engine(async_url)
    out: dict[str, object] = {}
    async with engine.begin() as conn:
        await conn.execute(insert(orders).values(id=1, item="book"))
        out["committed"] = await receipt.enqueue(conn, {"order_id": 1, "email": "a@b.c"})
        out["thumb"] = await thumb.enqueue(conn, {"image_id": 1, "width": 64}, key="thumb-1")
        path = os.path.join(os.getcwd(), "label-effects.txt")
        out["label"] = await label.enqueue(conn, {"order_id": 1, "path": path})
        out["limited"] = await limited.enqueue(conn, {"order_id": 1, "email": "r@l.mt"})
    try:
        async with engine.begin() as conn:
            await conn.execute(insert(orders).values(id=2, item="pen"))
            out["rolled_back"] = await receipt.enqueue(conn, {"order_id": 2, "email": "x@y.z"})
            raise RuntimeError("rollback")
    except RuntimeError:
        pass
    try:
        async with engine.begin() as conn:
            await receipt.enqueue(conn, {"order_id": "three", "email": ""})
    except jobrelay.InvalidParams as exc:
        out["invalid"] = sorted(e["field"] for e in exc.errors)
    with sync_engine.begin() as conn:
        conn.execute(insert(orders).values(id=4, item="lamp"))
        out["sync"] = receipt.enqueue_sync(conn, {"order_id": 4, "email": "s@y.nc"})
    async with engine.connect() as conn:
        out["orders"] = sorted((await conn.execute(select(orders.c.id))).scalars())
    await engine.dispose()
    sync_engine.dispose()
    return out


print(json.dumps(asyncio.run(main())))
"""


def write_package(root: Path) -> Path:
    pkg = root / "shopapp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "jobs.py").write_text(textwrap.dedent(JOBS))
    (pkg / "client.py").write_text(textwrap.dedent(CLIENT))
    return root


def run_client(cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    ran = subprocess.run(
        [sys.executable, "-m", "shopapp.client"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    out: dict[str, Any] = json.loads(ran.stdout.strip().splitlines()[-1])
    return out


def sql_rows(url: str, query: str, **params: Any) -> list[Any]:
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(query), params).all())
    finally:
        engine.dispose()


def state_of(url: str, job_id: str) -> str | None:
    rows = sql_rows(url, "SELECT state FROM jobs WHERE id = :id", id=job_id)
    return str(rows[0][0]) if rows else None


def check_client_results(url: str, out: dict[str, Any]) -> None:
    assert out["invalid"] == ["email", "order_id"]
    assert out["orders"] == [1, 4]  # the rolled-back order is gone with its job
    assert state_of(url, out["rolled_back"]) is None
    assert (
        sql_rows(url, "SELECT count(*) FROM outbox WHERE job_id = :id", id=out["rolled_back"])[0][0]
        == 0
    )
    # Only the five committed jobs exist: the invalid one wrote nothing.
    assert sql_rows(url, "SELECT count(*) FROM jobs")[0][0] == 5
    for key in ("committed", "thumb", "sync", "label", "limited"):
        poll(lambda k=key: state_of(url, out[k]) == "succeeded", 60, f"{key} succeeded")


def events_of(url: str, job_id: str, kind: str) -> list[tuple[datetime, dict[str, Any]]]:
    rows = sql_rows(
        url,
        "SELECT at, detail FROM job_events WHERE job_id = :id AND kind = :kind ORDER BY id",
        id=job_id,
        kind=kind,
    )
    out = []
    for at, detail in rows:
        moment = at if isinstance(at, datetime) else datetime.fromisoformat(at)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        out.append((moment, json.loads(detail) if isinstance(detail, str) else detail))
    return out


def check_def_and_delayed_retry(url: str, root: Path, out: dict[str, Any]) -> None:
    """The def job ran once, in a thread; the retry asked for 2.5 s waited that long."""
    lines = (root / "label-effects.txt").read_text().splitlines()
    assert lines == [f"{out['label']} 1"], lines  # its side effect happened once
    assert len(events_of(url, out["label"], "result_saved")) == 1
    ((scheduled_at, scheduled),) = events_of(url, out["limited"], "retry_scheduled")
    assert scheduled["error"] == "rate limited"  # the reason is kept
    assert scheduled["askedDelaySeconds"] == 2.5 and scheduled["delaySeconds"] == 3
    claims = [at for at, _ in events_of(url, out["limited"], "claimed")]
    assert len(claims) == 2
    assert (claims[1] - scheduled_at).total_seconds() >= 2.5, (claims, scheduled_at)


def post_jobs(base: str, token: str) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    body = {"type": "shop.receipt", "params": {"order_id": 9, "email": "h@t.tp"}, "key": "o-9"}
    accepted = httpx.post(f"{base}/v1/jobs", json=body, headers=auth, timeout=10)
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["jobId"]
    hidden = httpx.post(
        f"{base}/v1/jobs",
        json={"type": "shop.thumb", "params": {"image_id": 2, "width": 8}},
        headers=auth,
        timeout=10,
    )
    assert hidden.status_code == 404, hidden.text
    unknown = httpx.post(
        f"{base}/v1/jobs", json={"type": "shop.nope", "params": {}}, headers=auth, timeout=10
    )
    assert unknown.status_code == 404
    poll(
        lambda: (
            httpx.get(f"{base}/v1/jobs/{job_id}", headers=auth, timeout=10).json()["state"]
            == "succeeded"
        ),
        60,
        "the HTTP job succeeded",
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_own_app_under_jobrelay_up_on_the_embedded_default(tmp_path: Path) -> None:
    root = write_package(tmp_path / "outside")
    db = tmp_path / "jobrelay.db"
    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{db}",
        JOBRELAY_RESULTS_URL=f"file://{tmp_path / 'results'}",
        **FAST_ENV,
    )
    port = free_port()
    with processes(tmp_path) as start:
        up = start("up", "up", "--app", "shopapp.jobs:app", "--port", str(port), env=env, cwd=root)
        wait_http(f"http://127.0.0.1:{port}", up)
        # One human line says where it listens and what it runs: a JSON log record like
        # every line it writes (plain text on stdout too when that is a terminal).
        [line] = [
            record["msg"]
            for text in up.log().splitlines()
            if (record := json.loads(text)).get("event") == "up_listening"
        ]
        base = f"http://127.0.0.1:{port}"
        assert line.startswith(
            f"jobrelay up: listening on {base} (console {base}/console, API docs {base}/docs); "
            "app shopapp.jobs:app ("
        )
        assert f"; database sqlite:///{db}; the local transport;" in line
        out = run_client(root, env)
        url = f"sqlite:///{db}"
        check_client_results(url, out)
        check_def_and_delayed_retry(url, root, out)
        token = run_cli("token", "create", "--account", "acme", env=env, cwd=root).stdout.strip()
        post_jobs(f"http://127.0.0.1:{port}", token)
    result = tmp_path / "results" / "shop.receipt" / out["committed"] / "receipt.txt"
    assert result.read_text() == "order 1 for a@b.c"


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.rabbitmq
@pytest.mark.timeout(300)
@pytest.mark.long
def test_own_app_with_relay_and_one_worker_per_queue(
    tmp_path: Path, pg_url: str, pg_app_url: str, amqp_app_url: str
) -> None:
    root = write_package(tmp_path / "outside")
    env = clean_env(
        JOBRELAY_DATABASE_URL=pg_app_url,  # the processes and the app: least-privileged
        JOBRELAY_BROKER_URL=amqp_app_url,
        JOBRELAY_RESULTS_URL=f"file://{tmp_path / 'results'}",
        JOBRELAY_APP="shopapp.jobs:app",
        **FAST_ENV,
    )
    # The owner migrates, creating the app's own tables, and grants the runtime role on them.
    owner = {**env, "JOBRELAY_DATABASE_URL": pg_url}
    role = urlsplit(pg_app_url).username or ""
    for command, as_env in ((("db", "upgrade"), owner), (("db", "grant", role), owner)):
        done = run_cli(*command, env=as_env, cwd=root)
        assert done.returncode == 0, done.stderr
    done = run_cli("broker", "declare", env=env, cwd=root)
    assert done.returncode == 0, done.stderr
    port = free_port()
    with processes(tmp_path) as start:
        api = start("api", "api", "--port", str(port), env=env, cwd=root)
        start("relay", "relay", env=env, cwd=root)
        default = start("worker-default", "worker", "--queue", "default", env=env, cwd=root)
        images = start("worker-images", "worker", "--queue", "images", env=env, cwd=root)
        wait_http(f"http://127.0.0.1:{port}", api)
        out = run_client(root, env)
        check_client_results(pg_url, out)
        check_def_and_delayed_retry(pg_url, root, out)
        token = run_cli("token", "create", "--account", "acme", env=env, cwd=root).stdout.strip()
        post_jobs(f"http://127.0.0.1:{port}", token)

        def claimer(job_id: str) -> str:
            rows = sql_rows(
                pg_url,
                "SELECT detail FROM job_events WHERE job_id = :id AND kind = 'claimed'",
                id=job_id,
            )
            detail = rows[0][0]
            return str(
                detail["worker"] if isinstance(detail, dict) else json.loads(detail)["worker"]
            )

        # Each queue is served by its own worker process: the worker id carries its pid.
        assert f":{default.pid}:" in claimer(out["committed"])
        assert f":{default.pid}:" in claimer(out["sync"])
        assert f":{images.pid}:" in claimer(out["thumb"])
