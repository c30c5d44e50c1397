"""The benchmark's app: the shipped export app plus ``bench.noop``, through the public API.

``bench.noop`` does nothing, so a drain of it measures what jobrelay always does per job
(the fenced claim, the completion and its events, the ack) against peers whose tasks make
the two status writes a user of theirs keeps. It is exposed over HTTP (``POST /v1/jobs``) so
the accept phase can use it too. The processes load it with ``JOBRELAY_APP=bench_app:app``
(``bench/`` on ``PYTHONPATH``); ``report.export`` stays available beside it.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

import jobrelay
from jobrelay.exports.shipped import app

NOOP = "bench.noop"


class Noop(BaseModel):
    n: int


@app.job(NOOP, params=Noop, http=True)
async def noop(ctx: jobrelay.JobContext[Noop], params: Noop) -> None:
    return None


# ``bench/limits_bench.py``: the no-op under a limit per key that never binds (100 keys x 64,
# far above the workers' slots) and one that binds (10 keys x 2).
OPEN_KEYS, OPEN_MAX, BOUND_KEYS, BOUND_MAX = 100, 64, 10, 2


@app.job(
    "bench.open",
    params=Noop,
    limits=[jobrelay.ConcurrencyLimit(OPEN_MAX, key=lambda p: f"k{p.n % OPEN_KEYS}")],
)
async def open_noop(ctx: jobrelay.JobContext[Noop], params: Noop) -> None:
    return None


@app.job(
    "bench.bound",
    params=Noop,
    limits=[jobrelay.ConcurrencyLimit(BOUND_MAX, key=lambda p: f"k{p.n % BOUND_KEYS}")],
)
async def bound_noop(ctx: jobrelay.JobContext[Noop], params: Noop) -> None:
    await asyncio.sleep(0.005)  # long enough to be seen running


__all__ = ["BOUND_KEYS", "BOUND_MAX", "NOOP", "app", "bound_noop", "noop", "open_noop"]
