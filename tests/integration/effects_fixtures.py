"""Fixtures for the external-effect tests around the real S3 and SMTP servers of
``jobrelay.chaos.sinks`` (the soak uses the same ones).

moto keeps its buckets in this process's memory, shared by every server instance, so tests
use a bucket of their own. Fixtures are registered under the names tests ask for (``name=``),
so a test module imports the ``*_fixture`` functions without shadowing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import get_session

from jobrelay.chaos.sinks import MailServer, S3Server, free_port
from jobrelay.domain.ids import request_hash
from jobrelay.storage.store import NewJob
from tests.id_keys import request_id

from .pipeline import Pipeline

ADDRESS = "ops@example.com"
MAIL_FROM = "jobrelay@example.com"
PUBLIC_URL = "https://exports.example.com"


@contextlib.contextmanager
def moto_subprocess() -> Iterator[str]:
    """moto in a process of its own, so its memory is not this process's (memory tests)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("moto server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(name="aws_env")
def aws_env_fixture(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake credentials for moto, and nothing read from the machine's AWS configuration."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture(name="s3_server")
def s3_server_fixture(aws_env: None) -> Iterator[S3Server]:
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture(name="bucket")
def bucket_fixture() -> str:
    return f"jobrelay-test-{uuid.uuid4().hex[:12]}"


@contextlib.asynccontextmanager
async def s3_client(endpoint: str) -> AsyncIterator[Any]:
    """An S3 client of the test's own, to look at the bucket behind jobrelay's back."""
    async with get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1"
    ) as client:
        yield client


async def create_bucket(endpoint: str, name: str) -> None:
    async with s3_client(endpoint) as s3:
        await s3.create_bucket(Bucket=name)


async def object_keys(endpoint: str, name: str) -> list[str]:
    async with s3_client(endpoint) as s3:
        listed = await s3.list_objects_v2(Bucket=name)
        return sorted(o["Key"] for o in listed.get("Contents", []))


async def open_uploads(endpoint: str, name: str) -> list[str]:
    async with s3_client(endpoint) as s3:
        listed = await s3.list_multipart_uploads(Bucket=name)
        return [u["Key"] for u in listed.get("Uploads", [])]


async def object_bytes(endpoint: str, name: str, key: str) -> bytes:
    async with s3_client(endpoint) as s3:
        got = await s3.get_object(Bucket=name, Key=key)
        async with got["Body"] as body:
            data: bytes = await body.read()
            return data


@pytest.fixture(name="mail_server")
def mail_server_fixture() -> Iterator[MailServer]:
    server = MailServer().start()
    yield server
    server.stop()


def effect_settings(s3: str, bucket: str, smtp: str, **extra: Any) -> dict[str, Any]:
    """The settings that turn on S3 results and e-mail, for ``settings_for(..., **these)``."""
    return {
        "results_url": f"s3://{bucket}/jobrelay",
        "s3_endpoint_url": s3,
        "smtp_url": smtp,
        "mail_from": MAIL_FROM,
        "public_url": PUBLIC_URL,
        **extra,
    }


async def submit_export(
    p: Pipeline, account: str = "acme", period: str = "2020-05", notify: str | None = ADDRESS
) -> str:
    """What ``POST /v1/exports`` stores for a body with ``notifyEmail``."""
    params: dict[str, Any] = {"accountId": account, "period": period}
    if notify is not None:
        params["notifyEmail"] = notify
    job = NewJob(
        job_id=await request_id(p.store, account, params),
        type="report.export",
        account_id=account,
        params=params,
        request_hash=request_hash(account, "report.export", params),
        max_attempts=p.rt.settings.max_attempts,
    )
    job_id, _ = await p.rt.store.submit(job, p.rt.clock())
    return job_id


async def eventually(
    check: Callable[[], Any], what: str, timeout: float = 30, interval: float = 0.05
) -> Any:
    """Poll ``check`` (sync or async) until it returns something truthy, or fail saying what."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")
