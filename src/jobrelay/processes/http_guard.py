"""The API's connection limits, enforced in the HTTP protocol itself: no proxy is assumed.

uvicorn's httptools protocol (the parser jobrelay runs, for its speed) bounds none of what a
client controls before its request reaches the application. Measured against ``jobrelay
api`` (tests/acceptance/test_server_limits.py): a 30 MB header was read whole and answered
``200``, and the memory stayed with the process; a connection that sent nothing, or one
header byte at a time, stayed open for as long as the client liked (uvicorn's keep-alive
timer runs only after a response, and every byte received cancels it); and any number of
connections were accepted. ``limit_concurrency`` only answers a *request* ``503``, after its
head has arrived, so it bounds none of these; h11's ``max_incomplete_event_size`` would
bound the head, but h11 alone would not bound time either, and it is the slower parser.

So this subclass of the httptools protocol adds, per connection:

- **a head size limit** (``JOBRELAY_API_MAX_HEAD_BYTES``): a request line and headers longer
  than that are answered ``431`` and the connection closed, having buffered at most the limit
  plus one read;
- **a head deadline** (``JOBRELAY_API_HEAD_TIMEOUT_SECONDS``): from a new connection, or from
  the first byte of a next request on a kept-alive one, the head must be complete in time,
  else the connection is closed (``408`` when some of it came);
- **a body deadline** (``JOBRELAY_API_BODY_TIMEOUT_SECONDS``): from the end of a head, the
  whole body must arrive in time, else the connection is closed (``408`` when no answer was
  started). It runs whether or not the application reads the body: a ``401`` answered before
  the body does not leave the connection to a client trickling the rest of it;
- **a write deadline** (``JOBRELAY_API_WRITE_TIMEOUT_SECONDS``): while the server has more to
  send than the transport buffers (a result download, a large page), the client must take
  some of it in time, else the connection is dropped; a slow reader that keeps reading is not
  cut off (what waits for it, the transport's buffer and the kernel's send queue, went down:
  the deadline starts again), a client that stopped reading is;
- **a connection cap** (``JOBRELAY_API_MAX_CONNECTIONS``), and a cap per client address
  (``JOBRELAY_API_MAX_CONNECTIONS_PER_ADDRESS``; not for the trusted proxies' addresses,
  where every client arrives): a connection over either is answered ``503`` with
  ``Retry-After`` at once and closed, before it can hold a slot;
- **problem+json for what the parser rejects**: the ``400`` uvicorn answers in plain text is
  ``application/problem+json`` like every other error.

Idle kept-alive connections are closed by uvicorn's keep-alive timeout (``api_server``).
Refusals close "lingeringly": the answer is sent, the write side shut, and what the client
still sends is read and dropped for a moment, so the client reads the answer instead of a
reset. All of it is plain arithmetic per read: the accept path pays nothing measurable
(docs/security.md has the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import http
import ipaddress
import json
import socket
import struct
import termios
import weakref
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_LINGER_SECONDS = 2.0  # how long a refused connection's remaining bytes are read and dropped
_HEAD_END = b"\r\n\r\n"
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset
_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None)  # SIOCOUTQ on Linux sockets


_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class HeadLimits:
    max_head_bytes: int
    head_timeout: float
    max_connections: int
    body_timeout: float = 30.0
    write_timeout: float = 30.0
    max_per_address: int = 100
    # Addresses not capped per address: the trusted proxies, every client's connections
    # arrive from them ("*": every address).
    uncapped: tuple[_Network, ...] = field(default_factory=tuple)
    uncap_all: bool = False

    @classmethod
    def uncapping(cls, proxies: list[str]) -> dict[str, Any]:
        """The ``uncapped``/``uncap_all`` arguments for JOBRELAY_TRUSTED_PROXIES' entries."""
        networks = tuple(ipaddress.ip_network(p, strict=False) for p in proxies if p != "*")
        return {"uncapped": networks, "uncap_all": "*" in proxies}

    def capped(self, address: str) -> bool:
        if self.uncap_all:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return True
        return not any(ip in network for network in self.uncapped)


def guarded_protocol(limits: HeadLimits) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn's ``http=`` with these limits; its own count of
    connections per address (one server, one class)."""
    return type("GuardedHttpToolsProtocol", (_Guarded,), {"limits": limits, "per_address": {}})


class _Guarded(HttpToolsProtocol):
    limits: HeadLimits
    per_address: dict[str, int]  # open connections per capped client address

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # waiting for (the rest of) a request head
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._unsent_at_timer = 0  # what the client had yet to take when the timer was set
        self._counted: str | None = None  # the address this connection counts against
        # Every request cycle of this connection not yet answered: uvicorn marks only the
        # last one parsed disconnected, not a pipelined one that is writing its response.
        self._cycles: weakref.WeakSet[Any] = weakref.WeakSet()
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, "too many connections: try again in a moment", retry_after=1)
            return
        address = self.client[0] if self.client else None
        if address is not None and self.limits.capped(address):
            if self.per_address.get(address, 0) >= self.limits.max_per_address:
                self._refuse(
                    503, "too many connections from this address: try again in a moment", 1
                )
                return
            self.per_address[address] = self.per_address.get(address, 0) + 1
            self._counted = address
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        self._cancel_write_timer()
        self._uncount()
        super().connection_lost(exc)

    def _uncount(self) -> None:
        address, self._counted = self._counted, None
        if address is not None:
            left = self.per_address.get(address, 1) - 1
            if left > 0:
                self.per_address[address] = left
            else:
                self.per_address.pop(address, None)

    # --- writing: a client that stops reading is dropped ----------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._arm_write_timer()

    def _arm_write_timer(self) -> None:
        self._unsent_at_timer = self._unsent()
        self._write_timer = self.loop.call_later(self.limits.write_timeout, self._stalled)

    def _unsent(self) -> int:
        """What the client has yet to take: the transport's buffer and, on Linux, the
        kernel's send queue (SIOCOUTQ: bytes not yet acknowledged). The kernel's queue is
        what a reader empties first: the transport's buffer moves only once megabytes of
        it have drained, so it alone would not show a slow reader reading."""
        unsent = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None and _OUTQ is not None:
            with contextlib.suppress(OSError, ValueError):  # closed meanwhile: the buffer
                queued = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
                unsent += struct.unpack("i", queued)[0]
        return unsent

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _stalled(self) -> None:
        self._write_timer = None
        if self._unsent() < self._unsent_at_timer:
            self._arm_write_timer()  # the client took some in time: a slow reader, reading
            return
        # Nothing can be said to a client that does not read: drop what is buffered, here
        # and in the kernel (a reset, not a FIN queued behind megabytes the client never
        # takes), and the connection; the responses still writing see a disconnect.
        for cycle in list(self._cycles):
            cycle.disconnected = True
            cycle.message_event.set()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # already gone: nothing left to drop
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        """What the parser cannot read (uvicorn's plain-text 400), as problem+json."""
        self._refuse(400, "the request is not valid HTTP/1.1")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: read and dropped
        if self._in_head:
            if self._head_timer is None:  # the first byte of a next request
                self._arm_head_timer()
            before = self._head_bytes
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                # Refused before parsing when the head's end is in this read and too far;
                # when it is not here, the parser says after this read whether it ended.
                end = data.find(_HEAD_END)
                if end >= 0 and before + end + len(_HEAD_END) > self.limits.max_head_bytes:
                    self._too_large()
                    return
        super().data_received(data)
        if (
            self._in_head
            and self._head_bytes > self.limits.max_head_bytes
            and not self.transport.is_closing()
        ):
            self._too_large()  # the head's end was not in this read: still over

    # --- parser callbacks: where a head starts and ends ----------------------------------

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_too_slow)
        super().on_headers_complete()
        if self.cycle is not None:
            self._cycles.add(self.cycle)

    def on_message_complete(self) -> None:
        self._cancel_body_timer()
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0  # a next request may follow

    # --- the deadline and the refusals ---------------------------------------------------

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_too_slow)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head or self._refused:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined head waits for the response before it
            return
        if self._head_bytes == 0:
            self.transport.close()  # nothing came: nothing to answer
        else:
            self._refuse(408, "the request head did not arrive in time")

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_too_slow(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self._refused:
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self.transport.close()  # answered (or answering) already: only the slot is freed
            return
        if cycle is not None:  # the application sees a disconnect, and answers nothing
            cycle.disconnected = True
            cycle.message_event.set()
        self._refuse(408, "the request body did not arrive in time")

    def _too_large(self) -> None:
        self._refuse(431, f"the request head is over {self.limits.max_head_bytes} bytes")

    def _refuse(self, status: int, detail: str, retry_after: int | None = None) -> None:
        self._refused = True
        self._cancel_head_timer()
        self._cancel_body_timer()
        self.connections.discard(self)  # a refused connection no longer holds a slot
        self._uncount()
        phrase = http.HTTPStatus(status).phrase
        body = json.dumps(
            {"type": "about:blank", "title": phrase, "status": status, "detail": detail}
        ).encode()
        head = [
            f"HTTP/1.1 {status} {phrase}",
            "content-type: application/problem+json",
            f"content-length: {len(body)}",
            "connection: close",
        ]
        if retry_after is not None:
            head.append(f"retry-after: {retry_after}")
        transport = self.transport
        transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(_LINGER_SECONDS, transport.close)
        else:
            transport.close()
