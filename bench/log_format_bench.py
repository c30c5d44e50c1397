"""Microseconds per log line through jobrelay's JSON formatter (observe/logs.py).

A worker's lifecycle line as it is logged: a record with ``event``/``jobId``/``attempt``
extras inside a ``bound()`` block (``traceId``, ``jobId``), formatted as the stderr handler
formats it, scrubber included; plus a line with non-ASCII text and one with a URL
credential (the slower paths). Run it against another tree with ``PYTHONPATH=.../src``.
It measures CPU time of the formatter alone (no I/O); a busy machine shows as noise.
"""

from __future__ import annotations

import argparse
import logging
import time
import uuid

from jobrelay.observe import logs


def _record(msg: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("jobrelay.worker", logging.INFO, "", 0, msg, None, None)
    record.__dict__.update(extra)
    return record


def _per_line(formatter: logging.Formatter, record: logging.LogRecord, lines: int) -> float:
    best = float("inf")
    for _ in range(5):  # the best of five runs: the least disturbed by the neighbours
        started = time.perf_counter()
        for _ in range(lines):
            formatter.format(record)
        best = min(best, (time.perf_counter() - started) / lines)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=20_000, help="lines per run")
    args = parser.parse_args()
    formatter = logs.JsonFormatter("worker")
    job_id = str(uuid.uuid4())
    cases = {
        "lifecycle": _record("ack_sent", event="ack_sent", jobId=job_id, attempt=1),
        "non-ascii": _record("opération échouée", event="released", jobId=job_id),
        "credential": _record("connect amqp://app:s3cret@mq:5672/ failed", event="x"),
    }
    with logs.bound(traceId="4bf92f3577b34da6a3ce929d0e0e4736", jobId=job_id):
        for name, record in cases.items():
            print(f"{name:>10}: {_per_line(formatter, record, args.lines):6.2f} us/line")


if __name__ == "__main__":
    main()
