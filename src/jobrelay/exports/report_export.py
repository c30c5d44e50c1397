"""``report.export``: one account's ledger for one month, as CSV, under a stable key.

Rows are streamed from a server-side cursor and written in chunks, so memory stays flat
whatever the month's size. Text cells are defanged against spreadsheet formula injection
(OWASP "CSV injection"): a description typed as ``=HYPERLINK(...)`` must open as text, not
run. Amounts are formatted from decimals by us, so they are numbers by construction and are
left as they are (a leading minus is a negative amount, not a formula).
"""

from __future__ import annotations

import csv
import io
import re
import time
from collections.abc import Mapping
from typing import Any

from jobrelay.domain.effects import check_address
from jobrelay.effects.notify_email import NOTIFY_PARAM, notification_for
from jobrelay.errors import PermanentError
from jobrelay.operations.base import OperationContext, OperationResult

TYPE = "report.export"
COLUMNS = ("entry_id", "booked_on", "description", "counterparty", "amount", "currency")
ACCOUNT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_PERIOD = re.compile(r"^(19|2[0-9])[0-9]{2}-(0[1-9]|1[0-2])$")
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n")
_ROWS_PER_CHUNK = 500
_PROGRESS_EVERY_SECONDS = 0.5


def result_key(account_id: str, job_id: str) -> str:
    return f"exports/{account_id}/{job_id}.csv"


def defang(cell: str) -> str:
    """Prefix a quote so spreadsheets show the text instead of evaluating it."""
    return "'" + cell if cell.startswith(_FORMULA_START) else cell


class ReportExport:
    type = TYPE

    def validate(self, params: Mapping[str, Any]) -> None:
        if set(params) - {NOTIFY_PARAM} != {"accountId", "period"}:
            raise PermanentError(
                f"report.export takes accountId, period and optionally {NOTIFY_PARAM},"
                f" got {sorted(params)}"
            )
        if NOTIFY_PARAM in params:
            try:
                check_address(str(params[NOTIFY_PARAM]))
            except ValueError as exc:
                raise PermanentError(f"invalid {NOTIFY_PARAM}: {exc}") from None
        account, period = params["accountId"], params["period"]
        if not isinstance(account, str) or not ACCOUNT_PATTERN.match(account):
            raise PermanentError(f"invalid accountId {account!r}")
        if not isinstance(period, str) or not _PERIOD.match(period):
            raise PermanentError(f"invalid period {period!r}; expected YYYY-MM")

    async def run(self, ctx: OperationContext) -> OperationResult:
        job = ctx.job
        self.validate(job.params)
        await ctx.faults.ahit("export.run", attempt=ctx.attempt, params=job.params)
        account, period = job.params["accountId"], job.params["period"]
        if account != job.account_id:
            raise PermanentError("accountId in params does not match the job's account")
        total = await ctx.store.ledger_count(account, period)
        await ctx.report_progress(0, total)
        key = result_key(account, job.id)
        rows = 0
        last_report = time.monotonic()
        buffer = io.StringIO()
        out = csv.writer(buffer, lineterminator="\r\n")
        session = ctx.results.writer(key)
        async with session as writer:
            out.writerow(COLUMNS)
            async for row in ctx.store.stream_ledger(account, period):
                out.writerow(
                    (
                        row.id,
                        row.booked_on.isoformat(),
                        defang(row.description),
                        defang(row.counterparty),
                        f"{row.amount:.2f}",
                        row.currency,
                    )
                )
                rows += 1
                if rows % _ROWS_PER_CHUNK == 0:
                    await writer.write(_drain(buffer))
                    if time.monotonic() - last_report >= _PROGRESS_EVERY_SECONDS:
                        await ctx.report_progress(rows, max(total, rows))
                        last_report = time.monotonic()
            await writer.write(_drain(buffer))
        stored = session.result
        notification = notification_for(job)
        return OperationResult(
            result_key=key,
            meta={"rows": rows, "bytes": stored.size, "sha256": stored.sha256},
            follow_ups=(notification,) if notification is not None else (),
        )


def _drain(buffer: io.StringIO) -> bytes:
    data = buffer.getvalue().encode("utf-8")
    buffer.seek(0)
    buffer.truncate()
    return data
