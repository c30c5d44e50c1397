"""The application side: a ``signups`` table, and a signup that enqueues in its transaction.

python -m examples.first_job.main                 # one signup committed, one rolled back
python -m examples.first_job.main show JOB_ID     # the job, as app.get_job sees it
"""

from __future__ import annotations

import asyncio
import sys

from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

import jobrelay
from examples.first_job.app import Welcome, app, send_welcome

metadata = MetaData()
signups = Table(
    "signups",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("email", String(200), nullable=False),
)


# The application's own engine, on the same database as jobrelay's tables.
# ``jobrelay.create_engine`` takes the same URL as ``JOBRELAY_DATABASE_URL`` and picks the
# async driver; on SQLite it also sets the WAL mode and the write transactions jobrelay's own
# processes use, so the app's writes wait for theirs instead of failing "database is locked".
def app_engine() -> AsyncEngine:
    return jobrelay.create_engine(app.settings.database_url)


async def sign_up(conn: AsyncConnection, email: str) -> tuple[int, str]:
    """Insert the signup and enqueue its welcome job, both on ``conn``: one transaction."""
    row = await conn.execute(insert(signups).values(email=email).returning(signups.c.id))
    signup_id = row.scalar_one()
    job_id = await send_welcome.enqueue(conn, Welcome(signup_id=signup_id, email=email))
    return signup_id, job_id


class SignupRefused(Exception):
    pass


async def main() -> None:
    engine = app_engine()
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)  # the app's own table; jobrelay's come
        # from `jobrelay db upgrade`, which `jobrelay up` runs itself

    async with engine.begin() as conn:  # commits at the end of the block
        signup_id, job_id = await sign_up(conn, "ada@example.com")
    job = await app.get_job(job_id)
    assert job is not None
    print(f"committed: signup {signup_id}, job {job_id} is {job.state.value}")

    try:
        async with engine.begin() as conn:  # rolls back: the exception leaves the block
            _, lost_job_id = await sign_up(conn, "mallory@example.com")
            raise SignupRefused("refused after the enqueue")
    except SignupRefused:
        pass
    async with engine.connect() as conn:
        left = await conn.scalar(
            select(func.count())
            .select_from(signups)
            .where(signups.c.email == "mallory@example.com")
        )
    print(f"rolled back: {left} signup rows, job {lost_job_id} is {await app.get_job(lost_job_id)}")

    await engine.dispose()
    await app.aclose()


async def show(job_id: str) -> None:
    job = await app.get_job(job_id)
    if job is None:
        print(f"no job {job_id}")
    else:
        print(f"{job.type} {job.id}: {job.state.value}, attempt {job.attempt}/{job.max_attempts}")
        print(f"result {job.result_key} {job.result}")
    await app.aclose()


if __name__ == "__main__":
    if sys.argv[1:2] == ["show"]:
        asyncio.run(show(sys.argv[2]))
    else:
        asyncio.run(main())
