"""docs/how-to/use-with-django.md, run: the example shop (examples/django_shop/) places an
order and enqueues its shipping job in ``transaction.atomic()`` on Django's own connection
(sqlite3 or psycopg 3), in jobrelay's database. Commit: the order and the job exist and a
worker runs the job. An exception inside ``atomic()``: neither exists.

Django runs in a subprocess (``manage.py``), as a Django project does: its settings are
configured once per process, and each test has a fresh database.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from jobrelay.domain.states import JobState
from jobrelay.storage.tables import jobs
from jobrelay.worker.consumer import Worker

from .api_fixtures import build_runtime
from .test_library import Delivery

ROOT = Path(__file__).resolve().parents[2]
MANAGE = ROOT / "examples" / "django_shop" / "manage.py"


@pytest.fixture(autouse=True)
def _django_importable() -> None:
    if importlib.util.find_spec("django") is None:
        message = "Django unavailable: not importable (pip install -e '.[test]')"
        if os.environ.get("JOBRELAY_REQUIRE_SERVICES") == "1":
            pytest.fail(message + " (JOBRELAY_REQUIRE_SERVICES=1)", pytrace=False)
        pytest.skip(message)


def manage(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DJANGO_SHOP_DATABASE=database_url)
    return subprocess.run(
        [sys.executable, str(MANAGE), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def shop(database_url: str) -> str:
    """``database_url`` (jobrelay's schema already there) with the shop's tables migrated."""
    migrated = manage(database_url, "migrate", "--no-input")
    assert migrated.returncode == 0, migrated.stderr
    return database_url


def counts(database_url: str) -> tuple[int, int]:
    """(orders, shipping jobs) as another connection sees them."""
    url = make_url(database_url)
    sync = url.set(drivername="postgresql+psycopg") if url.get_backend_name() != "sqlite" else url
    engine = create_engine(sync)
    try:
        with engine.connect() as conn:
            orders = conn.execute(text("SELECT count(*) FROM shop_order")).scalar_one()
            shipping = select(func.count()).where(jobs.c.type == "shop.ship")
            return orders, conn.execute(shipping).scalar_one()
    finally:
        engine.dispose()


async def test_a_committed_order_has_its_job_and_a_worker_runs_it(
    shop: str, tmp_path: Path
) -> None:
    from examples.django_shop.shop.jobs import app

    placed = manage(shop, "place_order", "shoes")
    assert placed.returncode == 0, placed.stderr
    _, order_id, _, job_id = placed.stdout.split()
    assert counts(shop) == (1, 1)
    again = manage(shop, "place_order", "socks")  # another order, another job
    assert again.returncode == 0 and again.stdout.split()[3] != job_id

    rt = dataclasses.replace(build_runtime(shop, tmp_path), app=app)
    try:
        body = json.dumps({"jobId": job_id, "type": "shop.ship", "version": 1}).encode()
        delivery = Delivery(body)
        await Worker(rt).handle(delivery)
        assert delivery.outcomes == ["ack"]
        job = await rt.store.get_job(job_id)
        assert job is not None and job.state is JobState.SUCCEEDED
        assert job.params == {"order_id": int(order_id)}
    finally:
        await rt.engine.dispose()


def test_an_exception_inside_atomic_leaves_neither_order_nor_job(shop: str) -> None:
    declined = manage(shop, "place_order", "shoes", "--decline")
    assert declined.returncode == 1
    assert declined.stderr.strip() == "CommandError: payment for order 1 declined"
    assert counts(shop) == (0, 0)
