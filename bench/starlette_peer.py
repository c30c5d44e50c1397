"""The accept phase's peer: a bare Starlette + asyncpg endpoint doing jobrelay's accept.

``POST /v1/jobs`` with the same body the benchmark sends (``{"type", "params", "key"}``) and
the same work per request as ``jobrelay api``: the bearer token's SHA-256 looked up in
``api_tokens``, the body checked (an exposed type, ``params.n`` an integer, the key's
shape), the keyed job id and the request hash, then ONE transaction writing exactly what
``storage/drivers/new_job.py`` writes: the job row (``ON CONFLICT (id) DO NOTHING``, the request
hash compared when it already exists), its outbox row, ``pg_notify`` and the ``accepted``
event; a 202 with ``jobId``, ``statusUrl`` and ``Location``. It writes into the sandbox's
own jobrelay tables, after jobrelay's phases are over.

Served by uvicorn like ``jobrelay api``, with the same number of processes and the same
keep-alive; asyncpg with its prepared-statement cache and a pool as large as jobrelay's
(10 + 10 overflow). Run as ``python starlette_peer.py PORT PROCESSES`` with
``STARLETTE_PEER_DSN`` in the environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jobrelay.domain.messages import CURRENT_VERSION
from jobrelay.processes.api_server import KEEP_ALIVE_SECONDS
from jobrelay.storage.records import NOTIFY_CHANNEL, work_destination

NAMESPACE = uuid.UUID("5b0d3c1e-9f6a-4c55-b7a2-6a1f0e1d2c3b")  # jobrelay's, for equal ids
KEY = re.compile(r"^[A-Za-z0-9._:-]{1,255}$")
TYPES = {"bench.noop": (work_destination("default"), 3)}  # type -> (destination, attempts)
PROBLEM = "application/problem+json"

TOKEN = "SELECT account_id, is_admin FROM api_tokens WHERE token_hash = $1"
INSERT_JOB = """INSERT INTO jobs (id, type, account_id, params, idempotency_key, request_hash,
    state, attempt, max_attempts, queue, created_at, updated_at)
    VALUES ($1, $2, $3, $4, $5, $6, 'queued', 0, $7, $8, $9, $9)
    ON CONFLICT (id) DO NOTHING RETURNING id"""
EXISTING = "SELECT request_hash FROM jobs WHERE id = $1"
INSERT_OUTBOX = """INSERT INTO outbox (job_id, destination, body, headers, created_at)
    VALUES ($1, $2, $3, '{}', $4)"""
NOTIFY = f"SELECT pg_notify('{NOTIFY_CHANNEL}', '')"
INSERT_EVENT = """INSERT INTO job_events (job_id, at, kind, detail)
    VALUES ($1, $2, 'accepted', $3)"""


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def problem(status: int, detail: str) -> Response:
    return JSONResponse({"status": status, "detail": detail}, status, media_type=PROBLEM)


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    pool = await asyncpg.create_pool(os.environ["STARLETTE_PEER_DSN"], min_size=10, max_size=20)
    app.state.pool = pool
    try:
        yield
    finally:
        await pool.close()


async def ready(request: Request) -> Response:
    return JSONResponse({"status": "ready"})


async def create_job(request: Request) -> Response:
    pool: asyncpg.Pool = request.app.state.pool
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return problem(401, "send an API token as 'Authorization: Bearer <token>'")
    async with pool.acquire() as conn:
        principal = await conn.fetchrow(TOKEN, hashlib.sha256(token.encode()).hexdigest())
    if principal is None:
        return problem(401, "the API token is not valid")
    body = await request.body()
    if len(body) > 64 * 1024:
        return problem(413, "the request body is too large")
    try:
        request_body = json.loads(body)
        job_type, params, key = request_body["type"], request_body["params"], request_body["key"]
        if not isinstance(params, dict) or not isinstance(params.get("n"), int):
            raise ValueError("params.n must be an integer")
        if not isinstance(key, str) or not KEY.match(key):
            raise ValueError("bad key")
    except (ValueError, KeyError, TypeError) as exc:
        return problem(422, str(exc))
    if job_type not in TYPES:
        return problem(404, f"no job type {job_type!r} is exposed over HTTP")
    destination, max_attempts = TYPES[job_type]
    account = principal["account_id"]
    stored = {"n": params["n"]}
    identity = canonical({"type": job_type, "account": account, "key": key})
    job_id = str(uuid.uuid5(NAMESPACE, identity))
    digest = hashlib.sha256(
        canonical({"account": account, "type": job_type, "params": stored}).encode()
    ).hexdigest()
    now = datetime.now(UTC)
    message = json.dumps(
        {"jobId": job_id, "type": job_type, "version": CURRENT_VERSION}, separators=(",", ":")
    )
    async with pool.acquire() as conn, conn.transaction():
        inserted = await conn.fetchval(
            INSERT_JOB, job_id, job_type, account, json.dumps(stored), key, digest,
            max_attempts, "default", now,
        )  # fmt: skip
        if inserted is None:
            if await conn.fetchval(EXISTING, job_id) != digest:
                return problem(422, "this key was already used with a different request body")
        else:
            await conn.execute(INSERT_OUTBOX, job_id, destination, message, now)
            await conn.execute(NOTIFY)
            await conn.execute(INSERT_EVENT, job_id, now, json.dumps({"type": job_type}))
    status_url = f"/v1/jobs/{job_id}"
    return JSONResponse(
        {"accepted": True, "jobId": job_id, "statusUrl": status_url},
        202,
        headers={"Location": status_url},
    )


app = Starlette(
    routes=[Route("/v1/jobs", create_job, methods=["POST"]), Route("/readyz", ready)],
    lifespan=lifespan,
)


def main(argv: list[str]) -> None:
    port, processes = int(argv[0]), int(argv[1])
    uvicorn.run(
        "starlette_peer:app",
        host="127.0.0.1",
        port=port,
        workers=processes,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
