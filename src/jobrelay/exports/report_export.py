"""``report.export``: one account's ledger for one month, as CSV, under a stable key.

Written only against the public API (``@app.job``, ``JobContext``, ``Result``). The bytes are
``csv_format``'s, on every path: on PostgreSQL ``COPY`` writes the rows (defanged in SQL) at
the database's own speed; on SQLite batches of plain rows are formatted in Python. Either
way the CSV is streamed in chunks, so memory stays flat whatever the month's size, and the
count, the rows and so the file come from one snapshot (``ctx.snapshot()``). Text cells are
defanged against spreadsheet formula injection (``defang``). Amounts are formatted from
decimals, so they are numbers by construction and are left as they are (a leading minus is
a negative amount, not a formula).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

import jobrelay
from jobrelay.effects.notify_email import NOTIFY_EMAIL, check_address
from jobrelay.exports import csv_format, ledger
from jobrelay.storage.capabilities import capabilities_of

TYPE = "report.export"
COLUMNS = csv_format.COLUMNS
ACCOUNT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
PERIOD_PATTERN = re.compile(r"^(19|2[0-9])[0-9]{2}-(0[1-9]|1[0-2])$")
NOTIFY_PARAM = "notifyEmail"  # the parameter that asks for a notification
_BATCH_ROWS = 5000  # SQLite rows per hop to the driver's thread (~0.5 MB of CSV)
_PROGRESS_EVERY_SECONDS = 0.5


class ExportParams(BaseModel):
    """The stored parameters, in wire spelling; ``notifyEmail`` only when given."""

    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True)

    account_id: str = Field(alias="accountId", pattern=ACCOUNT_PATTERN.pattern)
    period: str = Field(pattern=PERIOD_PATTERN.pattern)
    notify_email: str | None = Field(default=None, alias=NOTIFY_PARAM)

    @field_validator("notify_email")
    @classmethod
    def _single_address(cls, value: str | None) -> str | None:
        return None if value is None else check_address(value)

    @model_serializer(mode="wrap")
    def _without_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A request without notifyEmail keeps the params (and so the jobId) it always had.
        dumped: dict[str, Any] = handler(self)
        return {k: v for k, v in dumped.items() if not (k == NOTIFY_PARAM and v is None)}


def result_key(account_id: str, job_id: str) -> str:
    return f"exports/{account_id}/{job_id}.csv"


def download_name(job_id: str, params: Mapping[str, Any]) -> str:
    account, period = params.get("accountId"), params.get("period")
    if isinstance(account, str) and isinstance(period, str):
        return f"export-{account}-{period}"
    return f"export-{job_id}"


async def run_export(
    ctx: jobrelay.JobContext[ExportParams], params: ExportParams
) -> jobrelay.Result:
    await ctx.fault_point("export.run")
    account, period = params.account_id, params.period
    if account != ctx.account:
        raise jobrelay.Permanent("accountId in params does not match the job's account")
    await ledger.ensure_table(ctx.engine)
    key = result_key(account, ctx.job_id)
    session = ctx.writer(key)
    try:
        # One snapshot for the count, the rows and so the file: a row committed meanwhile is
        # wholly in or wholly out, and the recorded count is the file's.
        async with ctx.snapshot() as conn:
            total = await ledger.count(conn, account, period)
            await ctx.progress(0, total)
            progress = _Progress(ctx, total)
            async with session as writer:
                await writer.write(csv_format.HEADER)
                if capabilities_of(conn).copies:
                    rows = await _copy_rows(conn, params, writer, progress)
                else:
                    rows = await _python_rows(conn, params, writer, progress)
            await ctx.progress(rows, rows)  # the export's own last word: every row written
    except (DBAPIError, OSError) as exc:
        raise ledger.read_failed(exc) from exc
    stored = session.result
    if params.notify_email is not None:
        ctx.follow_up(NOTIFY_EMAIL, {"exportJobId": ctx.job_id, "to": params.notify_email})
    return jobrelay.Result(
        key=key, meta={"rows": rows, "bytes": stored.size, "sha256": stored.sha256}
    )


class _Progress:
    """Reports the rows written at most every ``_PROGRESS_EVERY_SECONDS``."""

    def __init__(self, ctx: jobrelay.JobContext[ExportParams], total: int) -> None:
        self._ctx = ctx
        self._total = total
        self._last = time.monotonic()

    async def __call__(self, rows: int) -> None:
        if time.monotonic() - self._last >= _PROGRESS_EVERY_SECONDS:
            await self._ctx.progress(rows, max(self._total, rows))
            self._last = time.monotonic()


async def _copy_rows(
    conn: AsyncConnection, params: ExportParams, writer: jobrelay.ResultWriter, progress: _Progress
) -> int:
    """PostgreSQL: ``COPY`` makes the lines; Python only fixes the line ends and writes.
    Each chunk is awaited through the writer, so the event loop (the lease's heartbeat,
    other jobs) runs between chunks, and ``COPY`` waits while a slow writer catches up."""
    lines = csv_format.CopyLines()

    async def output(chunk: bytes) -> None:
        data = lines.feed(chunk)
        if data:
            await writer.write(data)
            await progress(lines.rows)

    reported = await ledger.copy_month(
        conn, params.account_id, params.period, csv_format.ROW_END_CELL, output
    )
    lines.finish()
    if reported != lines.rows:
        raise jobrelay.Retry(f"COPY reported {reported} rows but wrote {lines.rows}")
    return reported


async def _python_rows(
    conn: AsyncConnection, params: ExportParams, writer: jobrelay.ResultWriter, progress: _Progress
) -> int:
    """SQLite: batches of raw rows, formatted by ``csv_format.python_lines``."""
    rows = 0
    async for batch in ledger.fetch_month(conn, params.account_id, params.period, _BATCH_ROWS):
        await writer.write(csv_format.python_lines(batch))
        rows += len(batch)
        await progress(rows)
    return rows
