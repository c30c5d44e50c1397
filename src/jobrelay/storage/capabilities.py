"""What the database behind an engine can do, as the code outside storage needs to know it.

The one place outside the drivers that names a backend: everything above storage asks for a
capability (``store.capabilities.leads``, ``capabilities_of(conn).copies``), never which
database this is, so a new backend states its answers here once instead of in every caller.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay.storage.engine import libpq_dsn


@dataclass(frozen=True)
class Capabilities:
    listens: bool
    """A commit can wake a process elsewhere (``LISTEN``/``NOTIFY``): relays then wait for a
    notification instead of relying on their poll alone. Without it, only writers in the
    same process wake a relay."""

    leads: bool
    """Processes can elect one leader through the database (a session advisory lock, freed
    when the leader's session dies). Without it, one process uses the database and always
    leads."""

    vacuums: bool
    """``VACUUM (ANALYZE)`` refreshes the planner's statistics and the visibility map after a
    bulk write, which autovacuum may do late or (on some machines) never."""

    grants: bool
    """The database has roles and privileges, so each process can be given a role limited to
    what it does. Without them, whoever can open the file can do everything."""

    copies: bool
    """``COPY (query) TO STDOUT`` streams a query's rows as CSV formatted by the server, far
    cheaper than formatting every row in Python."""

    generates_series: bool
    """``generate_series()`` and ``make_date()``: n generated rows are one set-returning
    function call. Without them, a recursive CTE counts and the dates are computed as text."""

    prewarms: bool
    """A new connection costs a server round trip and a backend process, so opening the
    engine's pool before the first request spares the first burst that wait."""


POSTGRESQL = Capabilities(
    listens=True,
    leads=True,
    vacuums=True,
    grants=True,
    copies=True,
    generates_series=True,
    prewarms=True,
)
SQLITE = Capabilities(
    listens=False,
    leads=False,
    vacuums=False,
    grants=False,
    copies=False,
    generates_series=False,
    prewarms=False,
)
_BY_DIALECT = {"postgresql": POSTGRESQL, "sqlite": SQLITE}


def capabilities_of(bind: AsyncEngine | AsyncConnection | Engine | Connection) -> Capabilities:
    """The capabilities of the database ``bind`` is an engine or connection of."""
    return _BY_DIALECT[bind.dialect.name]


def session_dsn(engine: AsyncEngine) -> str:
    """The engine's URL as the driver takes it, for a session of the caller's own outside the
    pool: one that lives exactly as long as what it holds (a leader's advisory lock)."""
    return libpq_dsn(engine.url)
