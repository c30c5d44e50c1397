"""A server that is not the primary any more (issue 38): its errors drop the pool's
connections, so the next one is made afresh and lands on the primary.

Forced on one server: a pooled session made read-only answers a write with SQLSTATE 25006
(what a standby answers, or a primary demoted under a pooled connection). Without the engine's
``handle_error`` marking it a disconnect, the pool hands the same read-only session out again
and every write after it fails the same way.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from jobrelay.errors import ConfigError, StoreError, TransportError
from jobrelay.runtime import wiring
from jobrelay.runtime.wiring import START_OUTAGE_SECONDS, open_runtime, went_away
from jobrelay.storage.engine import FAILOVER_SQLSTATES, create_engine, failover_error

from .pipeline import settings_for

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(60)]


async def test_a_read_only_answer_drops_the_pool_and_the_next_write_lands(pg_url: str) -> None:
    engine = create_engine(pg_url)
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"))
            await conn.commit()
        # The pool keeps that one session (a pool of 20, one used): the next checkout is it.
        with pytest.raises(DBAPIError) as refused:
            async with engine.begin() as conn:
                await conn.execute(text("CREATE TABLE jobrelay_failover_probe (x int)"))
        assert failover_error(refused.value.orig)
        async with engine.begin() as conn:  # a fresh session: read-write again
            await conn.execute(text("CREATE TABLE jobrelay_failover_probe (x int)"))
            await conn.execute(text("DROP TABLE jobrelay_failover_probe"))
    finally:
        await engine.dispose()


def test_the_states_of_a_server_that_is_not_the_primary() -> None:
    class Raised(Exception):
        def __init__(self, sqlstate: str) -> None:
            self.sqlstate = sqlstate

    assert {"25006", "57P01", "57P02", "57P03"} <= FAILOVER_SQLSTATES
    assert failover_error(Raised("08006")) and failover_error(Raised("25006"))
    assert not failover_error(Raised("23505")) and not failover_error(Raised("40P01"))
    assert not failover_error(None)


async def test_a_database_that_goes_away_mid_start_is_waited_out_not_a_bad_setting(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """CI: a worker starting while PostgreSQL failed over exited 2, "local queue unreachable
    (run `jobrelay db upgrade`?): connection was closed in the middle of operation". The
    database had answered; its sessions were then cut (``start.after_schema:cut:1``, before
    the local transport's check). The process checks again and starts."""
    settings = settings_for(pg_url, "local", tmp_path, faults="start.after_schema:cut:1")
    with caplog.at_level(logging.WARNING, logger="jobrelay.start"):
        async with open_runtime(settings) as rt:
            await rt.transport.ping()
            async with rt.engine.connect() as conn:
                assert await conn.scalar(text("SELECT count(*) FROM jobs")) == 0
    waits = [r for r in caplog.records if getattr(r, "event", None) == "start_database_wait"]
    # asyncpg words the cut by where it found the session: "connection was closed in the
    # middle of operation", or (about one run in five) "cannot switch to state 15; another
    # operation (2) is in progress". Either way it was waited out, once.
    assert len(waits) == 1, caplog.text
    assert "the database went away during start-up" in waits[0].getMessage(), caplog.text


async def test_a_database_that_drops_the_first_check_mid_query_is_waited_out(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI of stop 54: a worker starting while PostgreSQL failed over exited 2 with
    "JOBRELAY_DATABASE_URL: database unreachable: ... connection was closed in the middle of
    operation": its very first check had reached the server, whose session was then cut, and
    was taken for a database never reached. Now that is an outage, waited out."""
    real = wiring.check_reachable
    calls = 0

    async def cut_once(engine: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            lost = DBAPIError(
                "SELECT 1",
                None,
                Exception("connection was closed in the middle of operation"),
                connection_invalidated=True,
            )
            raise StoreError("database unreachable: connection was closed") from lost
        await real(engine)

    monkeypatch.setattr(wiring, "check_reachable", cut_once)
    settings = settings_for(pg_url, "local", tmp_path, faults="")
    with caplog.at_level(logging.WARNING, logger="jobrelay.start"):
        async with open_runtime(settings) as rt:
            await rt.transport.ping()
    waits = [r for r in caplog.records if getattr(r, "event", None) == "start_database_wait"]
    assert calls >= 2 and len(waits) == 1, caplog.text


def _refused_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first start-up check finds no host answering at all (refused), as when the old
    primary is down and the new one does not take connections yet; later ones are real."""
    real = wiring.check_reachable
    calls: list[int] = []

    async def refused_once(engine: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            try:
                raise ConnectionRefusedError(111, "Connect call failed")
            except OSError as exc:
                raise StoreError(f"database unreachable: {exc}") from exc
        await real(engine)

    monkeypatch.setattr(wiring, "check_reachable", refused_once)
    return calls


async def test_no_host_of_several_answering_at_start_is_a_failover_waited_out(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI's failover soak (this stop): a relay restarted while PostgreSQL failed over found
    neither host taking connections and exited 2 at once ("database unreachable: Connection
    refused"), as for a wrong URL. With several hosts that is a failover: waited out."""
    calls = _refused_once(monkeypatch)
    two_hosts = pg_url.replace("@127.0.0.1:", "@127.0.0.1:1,127.0.0.1:", 1)
    assert two_hosts != pg_url
    settings = settings_for(two_hosts, "local", tmp_path, faults="")
    with caplog.at_level(logging.WARNING, logger="jobrelay.start"):
        async with open_runtime(settings) as rt:
            await rt.transport.ping()
    waits = [r for r in caplog.records if getattr(r, "event", None) == "start_database_wait"]
    assert len(calls) >= 2 and len(waits) == 1, caplog.text
    assert "no host of several answered at start-up" in waits[0].getMessage(), caplog.text


async def test_one_host_refusing_at_start_is_still_a_bad_setting_at_once(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same refusal from the only host named: a setting to fix, said at once."""
    calls = _refused_once(monkeypatch)
    settings = settings_for(pg_url, "local", tmp_path, faults="")
    with pytest.raises(ConfigError, match="JOBRELAY_DATABASE_URL: database unreachable"):
        async with open_runtime(settings):
            pass
    assert len(calls) == 1


async def test_a_database_never_reached_at_start_is_a_bad_setting_at_once(
    tmp_path: Path,
) -> None:
    """The wait above is for a database this process found: one it never reached is a
    setting to fix, said at once (no minute of retries before exit 2)."""
    settings = settings_for("postgresql://nobody@127.0.0.1:1/none", "local", tmp_path, faults="")
    started = time.monotonic()
    with pytest.raises(ConfigError, match="JOBRELAY_DATABASE_URL"):
        async with open_runtime(settings):
            pass
    assert time.monotonic() - started < START_OUTAGE_SECONDS / 2


def test_a_connection_refused_in_a_start_check_is_a_database_gone_away() -> None:
    """Review of stop 52: a reconnect refused mid-failover reaches the start-up checks as
    a bare ``OSError`` (SQLAlchemy does not wrap a connect that failed), under the local
    transport's ``TransportError`` and its ``ConfigError``: old code found no driver error
    in the chain and exited 2 at once, naming the broker."""
    try:
        try:
            try:
                raise ConnectionRefusedError(111, "Connect call failed")
            except OSError as exc:
                raise TransportError(f"local queue unreachable: {exc}") from exc
        except TransportError as exc:
            raise ConfigError("JOBRELAY_BROKER_URL", str(exc)) from None
    except ConfigError as exc:
        assert went_away(exc)
    assert not went_away(ConfigError("JOBRELAY_DATABASE_URL", "schema is at 0021"))
