"""The job commands take a jobId the way ``GET /v1/jobs/{jobId}`` does: the hyphenated
UUID in either case, and nothing else (braces, ``urn:uuid:``, bare hex are no job). In
process (typer's runner) on SQLite; the API side of the same rule is in test_api_edges."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jobrelay.cli.main import app
from jobrelay.domain.ids import canonical_job_id
from jobrelay.domain.states import JobState
from jobrelay.runtime.wiring import utc_now
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import Store

from .ops_fixtures import job_in_state

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def make_job(database_url: str, state: JobState, period: str = "2020-05") -> str:
    async def go() -> str:
        engine = create_engine(database_url)
        try:
            return await job_in_state(Store(engine), state, utc_now(), period)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def state_of(database_url: str, job_id: str) -> str:
    async def go() -> str:
        engine = create_engine(database_url)
        try:
            job = await Store(engine).get_job(job_id)
            assert job is not None
            return job.state.value
        finally:
            await engine.dispose()

    return asyncio.run(go())


def cli(database_url: str, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    env = {
        "JOBRELAY_DATABASE_URL": database_url,
        "JOBRELAY_RESULTS_URL": f"file://{tmp_path}/exports",
    }
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def test_the_api_forms_of_a_job_id() -> None:
    job_id = "355781a6-0b7c-5d1e-9f00-0123456789ab"
    assert canonical_job_id(job_id) == job_id
    assert canonical_job_id(job_id.upper()) == job_id
    for other in (f"{{{job_id}}}", f"urn:uuid:{job_id}", job_id.replace("-", ""), "", "x"):
        assert canonical_job_id(other) is None, other


def test_job_show_takes_the_upper_case_form_and_refuses_the_others(
    sqlite_url: str, tmp_path: Path
) -> None:
    job_id = make_job(sqlite_url, JobState.QUEUED)
    code, out, err = cli(sqlite_url, tmp_path, "job", "show", job_id.upper(), "--json")
    assert code == 0, err
    assert f'"jobId": "{job_id}"' in out
    for other in (f"{{{job_id}}}", f"urn:uuid:{job_id}", job_id.replace("-", "")):
        code, out, err = cli(sqlite_url, tmp_path, "job", "show", other)
        assert (code, out) == (1, ""), (other, err)
        assert err == f"jobrelay: error: no job {other}\n"


def test_cancel_and_replay_take_the_upper_case_form(sqlite_url: str, tmp_path: Path) -> None:
    queued = make_job(sqlite_url, JobState.QUEUED)
    code, out, err = cli(sqlite_url, tmp_path, "job", "cancel", queued.upper(), "--reason", "t")
    assert code == 0, err
    assert out.startswith(f"cancelled {queued} ") and state_of(sqlite_url, queued) == "cancelled"

    quarantined = make_job(sqlite_url, JobState.QUARANTINED, "2020-06")
    code, out, err = cli(sqlite_url, tmp_path, "job", "replay", quarantined.upper())
    assert code == 0, err
    assert (
        out.startswith(f"replayed {quarantined}: ")
        and state_of(sqlite_url, quarantined) == "queued"
    )

    bare = quarantined.replace("-", "")
    code, out, err = cli(sqlite_url, tmp_path, "job", "replay", bare)
    assert (code, err) == (1, f"jobrelay: error: no job {bare}\n")
