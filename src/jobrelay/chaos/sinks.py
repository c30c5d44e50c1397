"""Real servers for external effects: an S3-compatible server and a recording SMTP server.

The soak and the effect tests need to see exactly what jobrelay sent to the outside world, so
both run in the checking process where their records can be read back:

- ``S3Server``: moto's S3 over real HTTP (werkzeug on a loopback port, as moto's own
  ``ThreadedMotoServer`` does), behind a switch that answers every write with
  ``503 SlowDown`` while ``failing`` is set, so a test can make S3 flaky and heal it.
- ``MailServer``: aiosmtpd on a loopback port, recording every message it accepts; while
  ``refuse_with`` is set it answers DATA with that reply instead and records nothing.

Both can be given a port in advance, so a test can point jobrelay at a port with nothing
behind it (unreachable) and start the server there later. moto keeps buckets in this
process's memory, shared by every instance, so each user takes a bucket of its own.
"""

from __future__ import annotations

import email
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from email.message import Message
from typing import Any

from aiosmtpd.controller import Controller
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import BaseWSGIServer, make_server

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
