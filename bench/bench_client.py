"""The benchmark's HTTP side: an export request per number, submitted at a fixed concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import httpx
from bench_env import BenchFailure, RoleProcess

ACCOUNTS = ("acme", "globex", "initech")
PERIODS = tuple(f"{year}-{month:02d}" for year in (2019, 2020, 2021) for month in range(1, 13))


def export_body(i: int) -> dict[str, str]:
    """Request ``i``: the three seeded accounts in turn, each month of 2019-2021 in turn."""
    return {
        "accountId": ACCOUNTS[i % len(ACCOUNTS)],
        "period": PERIODS[(i // len(ACCOUNTS)) % len(PERIODS)],
    }


def api_client(port: int, token: str, concurrency: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {token}"},
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        timeout=60.0,
        trust_env=False,  # loopback only: never through a proxy from the environment
    )


async def wait_ready(client: httpx.AsyncClient, api: RoleProcess, timeout: float) -> float:
    """Wait for ``/readyz`` to answer 200; seconds since the process was started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        api.check_alive()
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/readyz")).status_code == 200:
                return time.time() - api.spawned_at
        await asyncio.sleep(0.1)
    raise BenchFailure(f"api not ready within {timeout:g}s:\n{api.tail()}")


@dataclass
class Submitted:
    job_ids: list[str]
    seconds: float
    latencies: list[float]  # per POST, seconds


def request_for(job: str, i: int, key: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    """Path, body and headers of request ``i``: an export, or ``bench.noop`` via /v1/jobs."""
    if job == "noop":
        return "/v1/jobs", {"type": "bench.noop", "params": {"n": i}, "key": key}, {}
    return "/v1/exports", export_body(i), {"Idempotency-Key": key}


async def submit(
    client: httpx.AsyncClient, n: int, concurrency: int, key_prefix: str, job: str = "export"
) -> Submitted:
    """N POSTs over ``concurrency`` connections, each with its own idempotency key (so each
    one creates a job); every answer must be a 202 with a distinct jobId."""
    job_ids = [""] * n
    latencies: list[float] = []
    failures: list[str] = []
    numbers = iter(range(n))

    async def lane() -> None:
        for i in numbers:
            path, body, headers = request_for(job, i, f"{key_prefix}-{i}")
            sent = time.perf_counter()
            try:
                response = await client.post(path, json=body, headers=headers)
            except httpx.HTTPError as exc:
                failures.append(f"request {i}: {exc!r}")
                continue
            latencies.append(time.perf_counter() - sent)
            if response.status_code != 202:
                failures.append(f"request {i}: {response.status_code} {response.text[:300]}")
                continue
            job_ids[i] = str(response.json()["jobId"])

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    if failures:
        raise BenchFailure(
            f"{key_prefix}: {len(failures)} of {n} POSTs were not 202; first: "
            + "; ".join(failures[:3])
        )
    if len(set(job_ids)) != n:
        raise BenchFailure(f"{key_prefix}: {n} POSTs returned {len(set(job_ids))} distinct jobIds")
    return Submitted(job_ids, seconds, latencies)


async def submit_at_rate(
    client: httpx.AsyncClient, n: int, rate: float, key_prefix: str, job: str = "export"
) -> Submitted:
    """N POSTs sent on a fixed schedule (request i at i / ``rate`` seconds), not as fast as
    possible: latency measured under a load the system can carry, not in a burn-down."""
    job_ids = [""] * n
    latencies: list[float] = []
    failures: list[str] = []
    started = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
        path, body, headers = request_for(job, i, f"{key_prefix}-{i}")
        sent = time.perf_counter()
        try:
            response = await client.post(path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            failures.append(f"request {i}: {exc!r}")
            return
        latencies.append(time.perf_counter() - sent)
        if response.status_code != 202:
            failures.append(f"request {i}: {response.status_code} {response.text[:300]}")
            return
        job_ids[i] = str(response.json()["jobId"])

    await asyncio.gather(*(one(i) for i in range(n)))
    if failures:
        raise BenchFailure(
            f"{key_prefix}: {len(failures)} of {n} POSTs were not 202; first: "
            + "; ".join(failures[:3])
        )
    return Submitted(job_ids, time.perf_counter() - started, latencies)
