"""``report.export``: one account's ledger for one month, as CSV, under a stable key.

Written only against the public API (``@app.job``, ``JobContext``, ``Result``). Rows are
streamed from a server-side cursor and written in chunks, so memory stays flat whatever the
month's size. Text cells are defanged against spreadsheet formula injection (OWASP "CSV
injection"): a description typed as ``=HYPERLINK(...)`` must open as text, not run. Amounts
are formatted from decimals by us, so they are numbers by construction and are left as they
are (a leading minus is a negative amount, not a formula).
"""

from __future__ import annotations

import csv
import io
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

import jobrelay
from jobrelay.effects.notify_email import NOTIFY_EMAIL, check_address
from jobrelay.exports import ledger

TYPE = "report.export"
COLUMNS = ("entry_id", "booked_on", "description", "counterparty", "amount", "currency")
ACCOUNT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
PERIOD_PATTERN = re.compile(r"^(19|2[0-9])[0-9]{2}-(0[1-9]|1[0-2])$")
NOTIFY_PARAM = "notifyEmail"  # the parameter that asks for a notification
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n")
# A spreadsheet skips these before it decides whether a cell is a formula, so "  =1+1" or
# "\ufeff=1+1" is as dangerous as "=1+1": whitespace (str.isspace covers the no-break and
# other Unicode spaces), the zero-width characters and the byte-order mark.
_INVISIBLE = frozenset("\u200b\u200c\u200d\u2060\ufeff")
# The full-width forms, which some spreadsheets read as the ASCII operators.
_FORMULA_CHARS = frozenset("=+-@\uff1d\uff0b\uff0d\uff20")
_ROWS_PER_CHUNK = 500
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


def defang(cell: str) -> str:
    """Prefix a quote so spreadsheets show the text instead of evaluating it: a cell that
    starts with a formula character, a tab or a line break, or has a formula character after
    leading spaces or invisible characters."""
    if cell.startswith(_FORMULA_START):
        return "'" + cell
    visible = cell.lstrip()
    while visible and visible[0] in _INVISIBLE:
        visible = visible[1:].lstrip()
    return "'" + cell if visible[:1] in _FORMULA_CHARS and visible else cell


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
    try:
        async with ctx.read_only() as conn:
            total = await ledger.count(conn, account, period)
    except (DBAPIError, OSError) as exc:
        raise ledger.read_failed(exc) from exc
    await ctx.progress(0, total)
    key = result_key(account, ctx.job_id)
    rows = 0
    last_report = time.monotonic()
    buffer = io.StringIO()
    out = csv.writer(buffer, lineterminator="\r\n")
    session = ctx.writer(key)
    async with session as writer:
        out.writerow(COLUMNS)
        try:
            async with ctx.read_only() as conn:
                async for row in ledger.stream(conn, account, period):
                    out.writerow(
                        (
                            row.id,
                            row.booked_on.isoformat(),
                            defang(row.description),
                            defang(row.counterparty),
                            f"{row.amount:.2f}",
                            defang(row.currency),
                        )
                    )
                    rows += 1
                    if rows % _ROWS_PER_CHUNK == 0:
                        await writer.write(_drain(buffer))
                        if time.monotonic() - last_report >= _PROGRESS_EVERY_SECONDS:
                            await ctx.progress(rows, max(total, rows))
                            last_report = time.monotonic()
        except (DBAPIError, OSError) as exc:
            raise ledger.read_failed(exc) from exc
        await writer.write(_drain(buffer))
    stored = session.result
    if params.notify_email is not None:
        ctx.follow_up(NOTIFY_EMAIL, {"exportJobId": ctx.job_id, "to": params.notify_email})
    return jobrelay.Result(
        key=key, meta={"rows": rows, "bytes": stored.size, "sha256": stored.sha256}
    )


def _drain(buffer: io.StringIO) -> bytes:
    data = buffer.getvalue().encode("utf-8")
    buffer.seek(0)
    buffer.truncate()
    return data
