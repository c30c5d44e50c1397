"""Real servers for the external-effect tests: an S3-compatible server and an SMTP server.

- ``S3Server``: moto's S3 served over real HTTP by werkzeug on a loopback port (what moto's
  own ``ThreadedMotoServer`` does), wrapped in a switch that makes every write answer
  ``503 SlowDown`` while ``failing`` is set, so a test can make S3 flaky and heal it.
- ``MailServer``: aiosmtpd on a loopback port, recording every message it accepts. While
  ``refuse_with`` is set it answers DATA with that reply instead (and records nothing).

Both can be started on a port chosen in advance, so a test can point jobrelay at a port
with nothing behind it (unreachable) and start the server there later.

moto keeps its buckets in this process's memory, shared by every server instance, so tests
use a bucket of their own. Fixtures are registered under the names tests ask for (``name=``),
so a test module imports the ``*_fixture`` functions without shadowing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import email
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import get_session
from aiosmtpd.controller import Controller
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import BaseWSGIServer, make_server

from jobrelay.domain.ids import job_id_for, request_hash
from jobrelay.storage.store import NewJob

from .pipeline import Pipeline

ADDRESS = "ops@example.com"
MAIL_FROM = "jobrelay@example.com"
PUBLIC_URL = "https://exports.example.com"
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>injected by the test</Message></Error>"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _QuietHandler(MotoRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class S3Server:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.failing = False
        self.failed_writes = 0
        self._app = DomainDispatcherApplication(create_backend_app)
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wsgi(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if self.failing and environ["REQUEST_METHOD"] in ("PUT", "POST"):
            self.failed_writes += 1
            start_response("503 Slow Down", [("Content-Type", "application/xml")])
            return [_SLOW_DOWN]
        result: Iterable[bytes] = self._app(environ, start_response)
        return result

    def start(self) -> S3Server:
        self._server = make_server(
            "127.0.0.1", self.port, self._wsgi, threaded=True, request_handler=_QuietHandler
        )
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)


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


@dataclass
class Received:
    mail_from: str
    rcpt_tos: list[str]
    content: bytes

    @property
    def message(self) -> Message:
        return email.message_from_bytes(self.content)


@dataclass
class _Recorder:
    messages: list[Received] = field(default_factory=list)
    refuse_with: str | None = None

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        if self.refuse_with is not None:
            return self.refuse_with
        self.messages.append(
            Received(envelope.mail_from, list(envelope.rcpt_tos), envelope.content)
        )
        return "250 2.0.0 OK: queued"


class MailServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.recorder = _Recorder()
        self._controller: Controller | None = None

    @property
    def url(self) -> str:
        return f"smtp://127.0.0.1:{self.port}"

    @property
    def messages(self) -> list[Received]:
        return list(self.recorder.messages)

    def refuse(self, reply: str | None) -> None:
        self.recorder.refuse_with = reply

    def start(self) -> MailServer:
        self._controller = Controller(self.recorder, hostname="127.0.0.1", port=self.port)
        self._controller.start()
        return self

    def stop(self) -> None:
        if self._controller is not None:
            self._controller.stop()
            self._controller = None


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
        job_id=job_id_for(account, "report.export", params),
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
