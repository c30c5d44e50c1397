"""The benchmark's app: the shipped export app plus ``bench.noop``, through the public API.

``bench.noop`` does nothing, so a drain of it measures what jobrelay always does per job
(the fenced claim, the completion and its events, the ack) against peers whose tasks make
the two status writes a user of theirs keeps. It is exposed over HTTP (``POST /v1/jobs``) so
the accept phase can use it too. The processes load it with ``JOBRELAY_APP=bench_app:app``
(``bench/`` on ``PYTHONPATH``); ``report.export`` stays available beside it.
"""

from __future__ import annotations

from pydantic import BaseModel

import jobrelay
from jobrelay.exports.shipped import app

NOOP = "bench.noop"


class Noop(BaseModel):
    n: int


@app.job(NOOP, params=Noop, http=True)
async def noop(ctx: jobrelay.JobContext[Noop], params: Noop) -> None:
    return None


__all__ = ["NOOP", "app", "noop"]
