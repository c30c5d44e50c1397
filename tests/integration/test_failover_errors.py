"""A server that is not the primary any more (issue 38): its errors drop the pool's
connections, so the next one is made afresh and lands on the primary.

Forced on one server: a pooled session made read-only answers a write with SQLSTATE 25006
(what a standby answers, or a primary demoted under a pooled connection). Without the engine's
``handle_error`` marking it a disconnect, the pool hands the same read-only session out again
and every write after it fails the same way.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from jobrelay.storage.engine import FAILOVER_SQLSTATES, create_engine, failover_error

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
