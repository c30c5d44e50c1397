"""The benchmark's HTTP side: an export request per number, submitted at a fixed concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import json
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


class Lane:
    """One keep-alive HTTP/1.1 connection that sends one request at a time.

    The POSTs go through this rather than httpx: on a two-core machine httpx's CPU per
    request (about 5 ms) was more than the API's own, so the benchmark measured its client.
    Each lane owns its connection, so none sits idle in a pool while the others work; one
    idle longer than ``IDLE_EXPIRY`` (between phases) is replaced before it is used.
    """

    IDLE_EXPIRY = 4.0  # seconds; well under the servers' keep-alive (75 s)

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self.head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.last_used = 0.0

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        if self.streams is not None and time.monotonic() - self.last_used > self.IDLE_EXPIRY:
            await self.close()
        if self.streams is None:
            self.streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.streams
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.head}{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:
            status_line = await reader.readline()
            if not status_line:
                raise ConnectionResetError("the server closed the connection")
            length, close = 0, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                name, value = name.strip().lower(), value.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection":
                    close = value == "close"
                elif name == "transfer-encoding":
                    raise ValueError(f"unexpected transfer-encoding {value}")
            payload = await reader.readexactly(length)
        except BaseException:
            await self.close()
            raise
        self.last_used = time.monotonic()
        if close:
            await self.close()
        return int(status_line.split()[1]), payload

    async def close(self) -> None:
        if self.streams is not None:
            writer = self.streams[1]
            self.streams = None
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def submit(
    client: httpx.AsyncClient, n: int, concurrency: int, key_prefix: str, job: str = "export"
) -> Submitted:
    """N POSTs over ``concurrency`` connections (lanes to ``client``'s server, with its
    headers), each with its own idempotency key (so each one creates a job); every answer
    must be a 202 with a distinct jobId."""
    job_ids = [""] * n
    latencies: list[float] = []
    failures: list[str] = []
    numbers = iter(range(n))
    url = client.base_url
    assert url.host and url.port, url
    headers = {"Authorization": client.headers["Authorization"]}

    async def lane() -> None:
        connection = Lane(url.host, url.port, headers)
        try:
            for i in numbers:
                path, body, extra = request_for(job, i, f"{key_prefix}-{i}")
                sent = time.perf_counter()
                try:
                    status, payload = await connection.post(path, json.dumps(body).encode(), extra)
                except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
                    failures.append(f"request {i}: {exc!r}")
                    continue
                latencies.append(time.perf_counter() - sent)
                if status != 202:
                    failures.append(f"request {i}: {status} {payload[:300]!r}")
                    continue
                job_ids[i] = str(json.loads(payload)["jobId"])
        finally:
            await connection.close()

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
