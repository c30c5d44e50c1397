"""Job ids as the store under test derives them: keyed with its database's secret.

The tests' databases are copies of one migrated template per backend, so they share that
template's secret; a test that builds a ``NewJob`` the way ``POST /v1/exports`` would asks
the store for it rather than assuming one.
"""

from __future__ import annotations

from typing import Any

from jobrelay.domain.ids import job_id_for
from jobrelay.storage.records import utc_now
from jobrelay.storage.store import Store


async def id_secret(store: Store) -> bytes:
    """The secret ``store`` keys job ids with now (its database's installation row)."""
    return (await store.id_keys(utc_now())).current


async def request_id(
    store: Store,
    account: str,
    params: dict[str, Any],
    key: str | None = None,
    job_type: str = "report.export",
) -> str:
    """The jobId ``POST /v1/exports`` gives this request on ``store``'s database."""
    return job_id_for(await id_secret(store), account, job_type, params, key)
