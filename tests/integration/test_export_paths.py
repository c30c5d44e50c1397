"""``report.export``'s two paths, COPY on PostgreSQL and Python on SQLite: the same bytes.

The rows are the hard cases of the format (formula-looking cells behind spaces, tabs, NBSP,
zero-width characters and a BOM; quotes, commas, CR and LF, non-ASCII; NULLs; negative and
large amounts), in a ``ledger_entries`` made without its NOT NULL constraints so NULLs can
be stored. The export is the real operation, run in this process on the real stores.
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import hashlib
import io
import logging
import operator
import random
from collections.abc import Awaitable, Callable
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import (
    BigInteger,
    Column,
    Date,
    Integer,
    MetaData,
    Numeric,
    String,
    Table,
    Text,
    bindparam,
    insert,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import asyncpg as pg_asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

import jobrelay
from jobrelay.domain.ids import request_hash
from jobrelay.domain.states import JobState
from jobrelay.errors import TransientError
from jobrelay.exports import csv_format, ledger, report_export
from jobrelay.exports.defang import (
    FAST_HIGH,
    FAST_LOW,
    FORMULA_CHARS,
    INVISIBLE,
    SPACES,
    defang,
)
from jobrelay.exports.seed import seed_month
from jobrelay.exports.shipped import report_export as export_job
from jobrelay.library.operations import OperationContext
from jobrelay.observe.faults import Faults
from jobrelay.results.staging import StagingResults
from jobrelay.runtime.wiring import open_runtime
from jobrelay.settings import Settings
from jobrelay.storage.capabilities import capabilities_of
from jobrelay.storage.engine import create_engine, snapshot
from jobrelay.storage.store import Claim, NewJob
from tests.id_keys import request_id

pytestmark = pytest.mark.timeout(120)
PERIOD = "2020-05"
HOSTILE = [
    "Refund;=cmd|' /C calc'!A0",
    "Refund\t=cmd",
    "Refund;\t\u00a0@SUM(A1)",
    "a;;+1\r\n-2",
    "\t;=1",
    "=1+1",
    "+3",
    "-2+3",
    "@SUM(A1)",
    "\tx",
    "\rx",
    "\nx",
    "  =1+1",
    "\t=1+1",
    "\u00a0=HYPERLINK(x)",
    "\u3000+1",
    "\u2028-1",
    "\u200b@SUM(A1)",
    "\ufeff+1",
    " \u2060 \u200d-2",
    "\uff1d1+1",
    "\uff20x",
    "'already quoted",
    "",
    "   ",
    "\u200b",
    'say "hi"',
    '"',
    "a,b",
    ",",
    "line\nbreak",
    "carriage\rreturn",
    "crlf\r\ninside",
    "\r",
    ',"\r"\n',
    '\r""\n',
    "ends with cr\r",
    "Zürich café, 東京 🚀",
    "\\.",
    "NULL",
    "plain text",
]
AMOUNTS = [
    Decimal("0"),
    Decimal("0.01"),
    Decimal("-0.01"),
    Decimal("-2500.50"),
    Decimal("999999999999.99"),
    Decimal("-999999999999.99"),
    Decimal("123456789012.34"),
    None,
]
ALPHABET = list(SPACES + INVISIBLE + FORMULA_CHARS + ";\t\r\n,\"'aZ09 é€😀?~@AB\x84\x86")


def _nullable_table(*, plain_column: bool = False) -> Table:
    """``ledger_entries`` as the export reads it, but with NULLs allowed everywhere; with
    ``plain_column``, the generated column a table made by ``ensure_table`` has."""
    table = Table(
        "ledger_entries",
        MetaData(),
        Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
        Column("account_id", String(64)),
        Column("booked_on", Date),
        Column("period", String(7)),
        Column("description", Text),
        Column("counterparty", Text),
        Column("amount", Numeric(14, 2)),
        Column("currency", String(3)),
    )
    if plain_column:
        ledger.with_plain_column(table)
    return table


def hostile_rows(n: int = 600) -> list[dict[str, Any]]:
    rng = random.Random(16)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        if i < len(HOSTILE):
            description: str | None = HOSTILE[i]
        else:
            description = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
        rows.append(
            {
                "id": i + 1,
                "account_id": "acme",
                "booked_on": None if i % 53 == 5 else date(2020, 5, 1 + i % 28),
                "period": PERIOD,
                "description": None if i % 41 == 7 else description,
                "counterparty": rng.choice([*HOSTILE, None]),
                "amount": AMOUNTS[i % len(AMOUNTS)],
                "currency": rng.choice(["EUR", "=1", " @", "", None, "\u00a0-", "\ufeff"]),
            }
        )
    rows.append({**rows[0], "id": n + 1, "account_id": "globex"})  # another account
    rows.append({**rows[0], "id": n + 2, "period": "2020-06"})  # another month
    return rows


def expected_cells(row: dict[str, Any]) -> list[str]:
    """What a spreadsheet (any CSV reader) must read back from one row: the rule itself."""
    booked, amount = row["booked_on"], row["amount"]
    return [
        str(row["id"]),
        "" if booked is None else booked.isoformat(),
        defang(row["description"] or ""),
        defang(row["counterparty"] or ""),
        "" if amount is None else f"{amount:.2f}",
        defang(row["currency"] or ""),
    ]


@dataclasses.dataclass
class Exported:
    data: bytes
    meta: dict[str, Any]
    progress: list[tuple[int, int]]


async def run_export(
    database_url: str,
    results: Path,
    rows: list[dict[str, Any]] | None = None,
    *,
    on_progress: Callable[[int, int], Awaitable[None]] | None = None,
    plain_column: bool = True,
) -> Exported:
    """The real ``report.export`` of acme's 2020-05, on its own runtime."""
    settings = Settings(database_url=database_url, results_url=f"file://{results}")
    async with open_runtime(settings, connect_transport=False) as rt:
        if rows is not None:
            table = _nullable_table(plain_column=plain_column)
            async with rt.engine.begin() as conn:
                # The runtime created the app's table; this one takes its place.
                await conn.run_sync(lambda c: ledger.ledger_entries.drop(c, checkfirst=True))
                await conn.run_sync(table.metadata.create_all)
                await conn.execute(insert(table), rows)
        params = {"accountId": "acme", "period": PERIOD}
        job_id = await request_id(rt.store, "acme", params)
        new = NewJob(
            job_id,
            "report.export",
            "acme",
            params,
            request_hash("acme", "report.export", params),
            max_attempts=1,
        )
        await rt.store.submit(new, rt.clock())
        job = await rt.store.get_job(job_id)
        assert job is not None
        calls: list[tuple[int, int]] = []

        async def progress(done: int, total: int) -> None:
            calls.append((done, total))
            if on_progress is not None:
                await on_progress(done, total)

        staging = StagingResults(rt.results)
        context = OperationContext(
            job=job,
            attempt=1,
            store=rt.store,
            results=staging,
            faults=Faults(),
            report_progress=progress,
            clock=rt.clock,
        )
        result = await export_job.run(context)
        if capabilities_of(rt.engine).copies:  # which path the export took
            assert ledger._ensured[rt.engine.sync_engine] is (plain_column or rows is None)
        await staging.publish()
        assert result.result_key is not None
        data = (results / result.result_key).read_bytes()
        return Exported(data, result.meta, calls)


def records(data: bytes) -> list[list[str]]:
    return list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))


@pytest.mark.parametrize("plain_column", [True, False], ids=["plain-column", "no-plain-column"])
async def test_copy_and_python_paths_write_the_same_bytes(
    pg_url: str, sqlite_url: str, tmp_path: Path, plain_column: bool
) -> None:
    # Without the column: a table made before it existed, where every cell is tested.
    rows = hostile_rows()
    on_pg = await run_export(pg_url, tmp_path / "pg", rows, plain_column=plain_column)
    on_sqlite = await run_export(sqlite_url, tmp_path / "sqlite", rows)

    assert on_pg.data == on_sqlite.data  # byte for byte
    month = [r for r in rows if r["account_id"] == "acme" and r["period"] == PERIOD]
    parsed = records(on_pg.data)
    assert parsed[0] == list(report_export.COLUMNS)
    assert parsed[1:] == [expected_cells(r) for r in month]
    assert on_pg.data.startswith(b"entry_id,") and on_pg.data.endswith(b"\r\n")
    assert b"\r\n" in on_pg.data and b',"\r"\n' not in on_pg.data
    for exported in (on_pg, on_sqlite):
        assert exported.meta == {
            "rows": len(month),
            "bytes": len(exported.data),
            "sha256": hashlib.sha256(exported.data).hexdigest(),
        }


async def test_a_row_committed_during_the_export_is_wholly_out(
    database_url: str, tmp_path: Path
) -> None:
    url = database_url
    rows = hostile_rows(50)
    inserted: list[int] = []

    async def insert_one(done: int, total: int) -> None:
        # Called after the export counted, before it read a row: commit one more row.
        if inserted:
            return
        engine = create_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.execute(
                    insert(ledger.ledger_entries),
                    {**rows[1], "id": 10_000, "description": "late", "amount": Decimal(1)},
                )
        finally:
            await engine.dispose()
        inserted.append(10_000)

    exported = await run_export(url, tmp_path / "r", rows, on_progress=insert_one)

    assert inserted == [10_000]
    month = [r for r in rows if r["account_id"] == "acme" and r["period"] == PERIOD]
    parsed = records(exported.data)[1:]
    assert [cells[0] for cells in parsed] == [str(r["id"]) for r in month]  # no "10000"
    assert exported.progress[0] == (0, len(month))  # the count, from the same snapshot
    assert exported.meta["rows"] == len(parsed) == len(month)


async def test_progress_is_reported_while_rows_are_written(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = database_url
    monkeypatch.setattr(report_export, "_PROGRESS_EVERY_SECONDS", 0.0)  # after every chunk
    settings = Settings(database_url=url, results_url=f"file://{tmp_path}/unused")
    async with open_runtime(settings, connect_transport=False) as rt:
        await seed_month(rt.engine, "acme", PERIOD, 30_000)

    exported = await run_export(url, tmp_path / "r")

    assert exported.meta["rows"] == 30_000 == len(records(exported.data)) - 1
    done = [d for d, _ in exported.progress]
    assert exported.progress[0] == (0, 30_000)
    assert len(done) >= 3 and done == sorted(done) and any(0 < d < 30_000 for d in done)
    assert exported.progress[-1] == (30_000, 30_000)  # the export's own last report
    assert {t for _, t in exported.progress} == {30_000}


async def test_snapshot_is_repeatable_read_and_read_only(pg_url: str) -> None:
    engine = create_engine(pg_url)
    try:
        async with snapshot(engine) as conn:
            driver = (await conn.get_raw_connection()).driver_connection
            assert driver is not None
            # Asked through the driver: what a COPY sent on it would run in.
            assert await driver.fetchval("SHOW transaction_isolation") == "repeatable read"
            assert await driver.fetchval("SHOW transaction_read_only") == "on"
    finally:
        await engine.dispose()


# --- the defanging in SQL is the Python rule ----------------------------------------------

_RAW_COLUMNS = ("id", "booked_on", "description", "counterparty", "amount", "currency")


def _ledger_row(raw: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(_RAW_COLUMNS, raw, strict=True)) | {"account_id": "acme", "period": PERIOD}


async def _copied(engine: AsyncEngine) -> bytes:
    """acme's month through ``ledger.copy_month``, as the export's lines."""
    lines = csv_format.CopyLines()
    out: list[bytes] = []

    async def output(chunk: bytes) -> None:
        out.append(lines.feed(chunk))

    async with engine.begin() as conn:
        await conn.execute(text("SELECT 1"))  # the snapshot's first statement
        await ledger.copy_month(conn, "acme", PERIOD, csv_format.ROW_END_CELL, output)
    lines.finish()
    return b"".join(out)


async def test_a_plain_column_dropped_under_a_running_worker_costs_one_attempt(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    raw = [(1, date(2020, 5, 1), "=1+1", "ACME Ltd", Decimal("1.00"), "EUR")]
    engine = create_engine(pg_url)
    try:
        await ledger.ensure_table(engine)
        await ledger.replace(engine, "acme", [_ledger_row(r) for r in raw])
        async with engine.begin() as conn:
            await conn.execute(
                text(f"ALTER TABLE ledger_entries DROP COLUMN {ledger.PLAIN_COLUMN}")
            )
        with pytest.raises(jobrelay.Retry):
            await _copied(engine)  # the attempt that meets the dropped column
        with caplog.at_level(logging.WARNING, logger=ledger.__name__):
            await ledger.ensure_table(engine)  # the next attempt looks again
        assert ledger._ensured[engine.sync_engine] is False
        assert await _copied(engine) == csv_format.python_lines(raw)
    finally:
        await engine.dispose()
    assert any(getattr(r, "event", None) == "ledger_plain_column_missing" for r in caplog.records)


async def test_an_old_table_without_the_plain_column_is_named_in_a_warning(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=ledger.__name__):
        await run_export(pg_url, tmp_path / "old", hostile_rows(20), plain_column=False)
    warned = [
        r for r in caplog.records if getattr(r, "event", None) == "ledger_plain_column_missing"
    ]
    assert len(warned) == 1 and ledger.ADD_PLAIN_COLUMN in warned[0].getMessage()


async def test_a_table_made_by_ensure_table_has_the_plain_column(pg_url: str) -> None:
    engine = create_engine(pg_url)
    try:
        await ledger.ensure_table(engine)
        async with engine.connect() as conn:
            generated = await conn.scalar(
                text(
                    "SELECT attgenerated FROM pg_attribute"
                    " WHERE attrelid = 'ledger_entries'::regclass AND attname = :name"
                ),
                {"name": ledger.PLAIN_COLUMN},
            )
    finally:
        await engine.dispose()
    assert generated == b"s"  # stored, computed by the database on every write


# Most cells start with a character the fast test lets through, so most rows hinge on the
# rest of the test (a separator anywhere in any cell); the others are anything.
_PLAIN_FIRST = [c for c in ALPHABET if FAST_LOW < ord(c) < FAST_HIGH]


def _cell(size: int) -> st.SearchStrategy[str]:
    anything = st.text(st.sampled_from(ALPHABET), max_size=size)
    plain_first = st.builds(operator.add, st.sampled_from(_PLAIN_FIRST), anything)
    return st.one_of(plain_first, plain_first, anything).map(lambda cell: cell[:size])


_row_cells = st.tuples(_cell(6), _cell(6), _cell(3))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cells=st.lists(_row_cells, min_size=1, max_size=30))
@pytest.mark.long
def test_the_plain_column_never_spares_a_cell_the_rule_changes(
    pg_url: str, cells: list[tuple[str, str, str]]
) -> None:
    # Rows whose cells mix plain text with every character the rule looks at: the COPY
    # through the generated column writes what Python's rule writes.
    # First, every fixed hostile text alone in an otherwise plain row, in each text column.
    # The characters at the fast test's bounds first, too: "@" and U+0085 are not plain.
    edges = [*HOSTILE, "\x85=1", "\x84=1", "A\x85=1", "?=1", "A=1"]
    alone = [
        *((h, "ACME Ltd", "EUR") for h in edges),
        *(("Rent", h, "EUR") for h in edges),
        *(("Rent", "ACME Ltd", h[:3]) for h in edges),
    ]
    raw = [
        (i + 1, date(2020, 5, 1), d, c, Decimal("1.00"), cur)
        for i, (d, c, cur) in enumerate([*alone, *cells])
    ]

    async def exported() -> bytes:
        engine = create_engine(pg_url)
        try:
            await ledger.ensure_table(engine)
            assert ledger._ensured[engine.sync_engine] is True  # the column's path, not the other
            await ledger.replace(engine, "acme", [_ledger_row(r) for r in raw])
            return await _copied(engine)
        finally:
            await engine.dispose()

    assert asyncio.run(exported()) == csv_format.python_lines(raw)


_cells = st.text(
    st.one_of(
        st.sampled_from(ALPHABET),
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    ),
    max_size=8,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(values=st.lists(_cells, min_size=1, max_size=25))
@pytest.mark.long
def test_sql_defanging_is_python_defanging(pg_url: str, values: list[str]) -> None:
    dialect = pg_asyncpg.dialect()

    async def check() -> list[str | None]:
        conn = await asyncpg.connect(pg_url)
        try:
            out: list[str | None] = []
            for value in values:
                compiled = ledger.defanged_sql(value).compile(dialect=dialect)
                args = [compiled.params[name] for name in compiled.positiontup or ()]
                out.append(await conn.fetchval(str(compiled), *args))
            return out
        finally:
            await conn.close()

    assert asyncio.run(check()) == [defang(v) for v in values]


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(values=st.lists(_cells, min_size=2, max_size=2))
@example(values=["O'Brien \\' \\\\ x", "'); DROP TABLE ledger_entries; --"])
@pytest.mark.long
def test_a_copy_querys_values_are_quoted_as_the_server_reads_them(
    pg_url: str, values: list[str]
) -> None:
    """``COPY (query)`` takes no parameters: the values are rendered in the query
    (``ledger._CopyQuery``), quoted by SQLAlchemy's dialect, and read back exactly."""

    async def check() -> tuple[str, str]:
        engine = create_engine(pg_url)
        try:
            async with engine.connect() as conn:
                query = ledger._CopyQuery(
                    select(bindparam("a", type_=Text), bindparam("b", type_=Text)),
                    conn.dialect,
                    ("a", "b"),
                )
                driver = (await conn.get_raw_connection()).driver_connection
                assert driver is not None
                row = await driver.fetchrow(query.sql(a=values[0], b=values[1]))
                return row[0], row[1]
        finally:
            await engine.dispose()

    assert asyncio.run(check()) == (values[0], values[1])


async def test_fixed_hostile_cells_defang_the_same_in_sql(pg_url: str) -> None:
    dialect = pg_asyncpg.dialect()
    conn = await asyncpg.connect(pg_url)
    try:
        for value in HOSTILE:
            compiled = ledger.defanged_sql(value).compile(dialect=dialect)
            args = [compiled.params[name] for name in compiled.positiontup or ()]
            assert await conn.fetchval(str(compiled), *args) == defang(value), repr(value)
    finally:
        await conn.close()


# --- the lease is renewed while a long export streams ------------------------------------


class _GatedResults:
    """The runtime's results store, whose writers stop at their third chunk until the
    heartbeat has renewed the lease: the export can only finish if the heartbeat runs (and
    gets a database connection) while the export is in the middle of its rows."""

    def __init__(self, inner: Any, renewed: asyncio.Event) -> None:
        self._inner = inner
        self._renewed = renewed
        self.gate_passed = 0

    def writer(self, key: str, *, staged: bool = False, attempt: int | None = None) -> Any:
        return _GatedSession(self, self._inner.writer(key, staged=staged, attempt=attempt))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _GatedSession:
    def __init__(self, owner: _GatedResults, inner: Any) -> None:
        self._owner = owner
        self._inner = inner
        self._chunks = 0

    async def __aenter__(self) -> _GatedSession:
        self._writer = await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._inner.__aexit__(*exc)

    async def write(self, chunk: bytes) -> None:
        self._chunks += 1
        if self._chunks == 3:
            await asyncio.wait_for(self._owner._renewed.wait(), 20)
            self._owner.gate_passed += 1
        await self._writer.write(chunk)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_heartbeat_renews_the_lease_in_the_middle_of_an_export(
    make_pipeline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make_pipeline() as p:
        await seed_month(p.rt.engine, "acme", PERIOD, 20_000)
        renewed = asyncio.Event()
        renew = p.rt.store.renew_leases

        async def renew_and_tell(*args: Any, **kwargs: Any) -> set[Claim]:
            held: set[Claim] = await renew(*args, **kwargs)
            renewed.set()
            return held

        monkeypatch.setattr(p.rt.store, "renew_leases", renew_and_tell)
        gated = _GatedResults(p.rt.results, renewed)
        p.rt = dataclasses.replace(p.rt, results=gated)
        job_id = await p.submit("acme", PERIOD)
        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED, timeout=60)
        assert gated.gate_passed == 1 and job.attempt == 1
        assert job.result_meta["rows"] == 20_000


async def test_a_seeded_month_is_the_same_on_both_databases(
    pg_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    exported = []
    for url in (pg_url, sqlite_url):
        engine = create_engine(url)
        try:
            assert await seed_month(engine, "acme", PERIOD, 2_000) == 2_000
            await seed_month(engine, "globex", PERIOD, 3_000)
            await seed_month(engine, "globex", PERIOD, 500)  # replaces that month only
            async with engine.connect() as conn:
                assert await ledger.count(conn, "globex", PERIOD) == 500
                assert await ledger.count(conn, "acme", PERIOD) == 2_000
        finally:
            await engine.dispose()
        exported.append(await run_export(url, tmp_path / url.split(":")[0]))
    on_pg, on_sqlite = exported
    assert on_pg.data == on_sqlite.data and on_pg.meta["rows"] == 2_000
    assert b"'=HYPERLINK" in on_pg.data and b'"Line one\nline two"' in on_pg.data


class _FailingResults(_GatedResults):
    """Writers that fail at their third chunk, as a store that went away mid-export."""

    def writer(self, key: str, *, staged: bool = False, attempt: int | None = None) -> Any:
        return _FailingSession(self, self._inner.writer(key, staged=staged, attempt=attempt))


class _FailingSession(_GatedSession):
    async def write(self, chunk: bytes) -> None:
        self._chunks += 1
        if self._chunks == 3:
            raise TransientError("results store went away")
        await self._writer.write(chunk)


async def test_a_writer_failing_mid_copy_leaves_the_pool_usable(
    database_url: str, tmp_path: Path
) -> None:
    settings = Settings(database_url=database_url, results_url=f"file://{tmp_path}/r")
    async with open_runtime(settings, connect_transport=False) as rt:
        await seed_month(rt.engine, "acme", PERIOD, 20_000)
        params = {"accountId": "acme", "period": PERIOD}
        job_id = await request_id(rt.store, "acme", params)
        new = NewJob(
            job_id,
            "report.export",
            "acme",
            params,
            request_hash("acme", "report.export", params),
            max_attempts=2,
        )
        await rt.store.submit(new, rt.clock())
        job = await rt.store.get_job(job_id)
        assert job is not None

        async def progress(done: int, total: int) -> None:
            return None

        def context(results: Any) -> OperationContext:
            return OperationContext(
                job=job,
                attempt=1,
                store=rt.store,
                results=results,
                faults=Faults(),
                report_progress=progress,
                clock=rt.clock,
            )

        failing = StagingResults(_FailingResults(rt.results, asyncio.Event()))
        with pytest.raises(TransientError, match="went away"):
            await export_job.run(context(failing))
        leftovers = [p for p in (tmp_path / "r").rglob("*") if p.is_file()]
        assert leftovers == []  # the staged file was removed with the error
        # Every pooled connection still works: the next export, and a write, succeed.
        for _ in range(3):
            staging = StagingResults(rt.results)
            result = await export_job.run(context(staging))
            await staging.publish()
            assert result.meta["rows"] == 20_000
        async with rt.engine.begin() as conn:
            await conn.execute(
                insert(ledger.ledger_entries),
                {**hostile_rows(1)[0], "id": 99_999_999, "booked_on": date(2020, 5, 1)},
            )
