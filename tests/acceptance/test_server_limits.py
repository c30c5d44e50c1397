"""The API bounds its connections by itself, with no proxy in front (issue 25, items 3, 8;
issue 34, items 11 and 14).

Against a real ``jobrelay api`` on loopback, with raw sockets (an HTTP client would hide what
the server does with a connection): a request head over the limit is a ``431`` and the
connection is closed, and the memory is not kept; a connection that sends nothing, or
trickles its head, is closed at the head deadline, and one that trickles its body (with or
without a token) at the body deadline; a response the client does not read is cut off at the
write deadline, one read slowly but steadily is not; connections over the cap, or over one
address's cap, get a ``503`` and are closed; what the parser cannot read is a problem+json
``400``; no ``server`` header names the software. These are the HTTP server's limits,
below the application: the same on every database and broker, so SQLite stands for both.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.procs import Proc, clean_env, free_port, poll, processes, run_cli, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
HEAD_TIMEOUT = 1.0  # JOBRELAY_API_HEAD_TIMEOUT_SECONDS for this server
BODY_TIMEOUT = 1.0  # JOBRELAY_API_BODY_TIMEOUT_SECONDS
WRITE_TIMEOUT = 1.0  # JOBRELAY_API_WRITE_TIMEOUT_SECONDS
MAX_CONNECTIONS = 6  # JOBRELAY_API_MAX_CONNECTIONS for this server
PER_ADDRESS = 3  # JOBRELAY_API_MAX_CONNECTIONS_PER_ADDRESS
PATIENCE = 15.0  # how long the test waits for what should take HEAD_TIMEOUT; never asserted


class Api:
    def __init__(self, proc: Proc, port: int, token: str, root: Path) -> None:
        self.proc = proc
        self.port = port
        self.token = token
        self.root = root

    def connect(
        self, source: str = "127.0.0.1", receive_buffer: int | None = None
    ) -> socket.socket:
        """A connection from ``source`` (any 127.x.y.z is this host: each test that counts
        connections uses addresses of its own, so no other test's closing ones count)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:  # before connecting: it sets the window offered
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.settimeout(PATIENCE)
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def log_text(self) -> str:
        return "".join(path.read_text() for path in self.root.glob("api-*.log"))

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    root = tmp_path_factory.mktemp("limits")
    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{root}/jr.db",
        JOBRELAY_RESULTS_URL=f"file://{root}/exports",
        JOBRELAY_API_HEAD_TIMEOUT_SECONDS=str(HEAD_TIMEOUT),
        JOBRELAY_API_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
        JOBRELAY_API_BODY_TIMEOUT_SECONDS=str(BODY_TIMEOUT),
        JOBRELAY_API_WRITE_TIMEOUT_SECONDS=str(WRITE_TIMEOUT),
        JOBRELAY_API_MAX_CONNECTIONS_PER_ADDRESS=str(PER_ADDRESS),
    )
    assert run_cli("db", "upgrade", env=env).returncode == 0
    made = run_cli("token", "create", "--account", "acme", env=env)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip().splitlines()[-1]
    port = free_port()
    with processes(root) as start:
        proc = start("api", "api", "--port", str(port), env=env)
        wait_http(f"http://127.0.0.1:{port}", proc)
        yield Api(proc, port, token, root)


def read_until_closed(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    """Everything the server sends until it closes (or PATIENCE passes: then the test fails
    on what was, or was not, received)."""
    data = b""
    deadline = time.monotonic() + PATIENCE
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while len(data) < limit and time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                return data + b"<closed>"
            data += chunk
    return data


def response_to(sock: socket.socket, request: bytes) -> bytes:
    """One keep-alive request's response head and body (Content-Length bodies only)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def test_a_30_mb_header_is_431_the_connection_closed_and_the_memory_not_kept(api: Api) -> None:
    before = api.rss_kib()
    sock = api.connect()
    with sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        chunk, sent = b"a" * 65536, 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < 30 * 1024 * 1024:
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:  # the server answered: no need to send the rest
                    break
                sock.sendall(chunk)
                sent += len(chunk)
            else:
                sock.sendall(b"\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"application/problem+json" in answer and answer.endswith(b"<closed>")
    assert sent < 30 * 1024 * 1024  # refused on the way, not after reading it all
    # Generous: what matters is that 30 MB were not buffered (the issue saw +96 MB for 3).
    assert api.rss_kib() - before < 20 * 1024


def test_a_silent_connection_is_closed_at_the_head_deadline(api: Api) -> None:
    with api.connect() as sock:
        assert read_until_closed(sock) == b"<closed>"


def test_a_trickled_head_is_cut_off_at_the_head_deadline(api: Api) -> None:
    with api.connect() as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        deadline = time.monotonic() + PATIENCE
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # One header byte per HEAD_TIMEOUT / 4 (the attack is slowness: no event to wait on).
            while time.monotonic() < deadline and not select.select([sock], [], [], 0)[0]:
                sock.sendall(b"x")
                time.sleep(HEAD_TIMEOUT / 4)
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert answer.endswith(b"<closed>")


def test_connections_over_the_cap_get_503_and_are_closed(api: Api) -> None:
    held: list[socket.socket] = []
    try:
        # Kept-alive connections after one request each: idle, but not silent from the start;
        # from two addresses, each within its own cap (PER_ADDRESS).
        for n in range(MAX_CONNECTIONS):
            sock = api.connect(f"127.0.1.{n // PER_ADDRESS + 1}")
            held.append(sock)
            assert response_to(sock, HEALTHZ).startswith(b"HTTP/1.1 200 ")
        with api.connect("127.0.1.9") as over:
            answer = read_until_closed(over)
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        assert b"retry-after: 1" in answer.lower() and answer.endswith(b"<closed>")
        held.pop().close()

        def served() -> bool:
            with api.connect("127.0.1.9") as sock:
                return response_to(sock, HEALTHZ).startswith(b"HTTP/1.1 200 ")

        poll(served, PATIENCE, "a connection under the cap again")
    finally:
        for sock in held:
            sock.close()


def test_no_server_header_names_the_software(api: Api) -> None:
    with api.connect() as sock:
        head = response_to(sock, HEALTHZ)
    names = [line.split(b":", 1)[0].lower() for line in head.split(b"\r\n")[1:]]
    assert b"server" not in names, head
    assert b"date" in names


def test_one_address_holds_at_most_its_cap_and_others_are_still_served(api: Api) -> None:
    held: list[socket.socket] = []
    try:
        for _ in range(PER_ADDRESS):
            sock = api.connect("127.0.2.1")
            held.append(sock)
            assert response_to(sock, HEALTHZ).startswith(b"HTTP/1.1 200 ")
        with api.connect("127.0.2.1") as over:
            answer = read_until_closed(over)
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        assert b"retry-after: 1" in answer.lower() and answer.endswith(b"<closed>")

        def served() -> bool:  # another address, once the last test's closed ones are gone
            with api.connect("127.0.2.2") as other:
                return response_to(other, HEALTHZ).startswith(b"HTTP/1.1 200 ")

        poll(served, PATIENCE, "another address served while this one is at its cap")
    finally:
        for sock in held:
            sock.close()


def trickle_body(sock: socket.socket, path: str, token: str | None) -> bytes:
    """A POST whose 100-byte body never finishes: a byte per BODY_TIMEOUT / 4 until the
    server answers or closes; then what it sent until it closed."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    sock.sendall(head.encode())
    deadline = time.monotonic() + PATIENCE
    received = b""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        # The attack is slowness: no event to wait on. A first answer (a 401 before the body
        # is read) does not end it: the connection must not stay open for the rest.
        while time.monotonic() < deadline:
            if select.select([sock], [], [], 0)[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    return received + b"<closed>"
                received += chunk
                continue
            sock.sendall(b" ")
            time.sleep(BODY_TIMEOUT / 4)
    return received + read_until_closed(sock)


def test_a_trickled_body_without_a_token_is_cut_off_at_the_body_deadline(api: Api) -> None:
    with api.connect("127.0.3.1") as sock:
        answer = trickle_body(sock, "/v1/jobs", token=None)
    # The 401 comes before the body is read; a machine too slow to send it within the body
    # deadline gets the 408 instead. Either way the connection must not stay open.
    assert answer.startswith((b"HTTP/1.1 401 ", b"HTTP/1.1 408 ")), answer[:200]
    assert answer.endswith(b"<closed>"), answer[-200:]


def test_a_trickled_body_with_a_token_is_408_at_the_body_deadline(api: Api) -> None:
    with api.connect("127.0.3.2") as sock:
        answer = trickle_body(sock, "/v1/jobs", token=api.token)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"application/problem+json" in answer and answer.endswith(b"<closed>")
    # The route reading the body sees a disconnect: not an unhandled error in the log.
    assert "api_unhandled_error" not in api.log_text()


def tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of ``sock`` (1: established; a reset makes it 7, closed)."""
    return struct.unpack("B", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0]


def test_a_response_never_read_is_cut_off_at_the_write_deadline(api: Api) -> None:
    # Six pipelined requests for 1.7 MB of Swagger UI, never read: 10 MB, more than the
    # kernel's buffers take (4 MB on Linux), as a large result download is, so the server
    # holds bytes it cannot send. It must drop the connection (a reset: the kernel's buffered
    # bytes too), not keep it for as long as the client likes.
    asset = b"GET /docs/assets/swagger-ui-bundle.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with api.connect("127.0.4.1", receive_buffer=4096) as sock:
        sock.sendall(asset * 6)
        poll(lambda: tcp_state(sock) != 1, PATIENCE, "the server to drop the connection")


def test_a_slow_reader_that_keeps_reading_is_not_cut_off(api: Api) -> None:
    # The 10 MB of the test above, read 1 KiB every 0.1 s (10 KB/s): far slower than the
    # server's buffers drain in a write deadline, but the client takes some all along; for
    # four deadlines it must keep its connection.
    asset = b"GET /docs/assets/swagger-ui-bundle.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with api.connect("127.0.4.2", receive_buffer=4096) as sock:
        sock.sendall(asset * 6)
        received = 0
        reading_until = time.monotonic() + 4 * WRITE_TIMEOUT
        while time.monotonic() < reading_until:
            chunk = sock.recv(1024)  # a reset: ConnectionResetError
            assert chunk, f"closed after {received} bytes"
            received += len(chunk)
            time.sleep(0.1)  # the reader's pace, not a wait for the server
        assert tcp_state(sock) == 1
        assert received < 1_000_000  # still in the middle of the first response, as meant


def test_a_request_the_parser_rejects_is_a_problem_json_400(api: Api) -> None:
    with api.connect("127.0.5.1") as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: x\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    head, _, body = answer.removesuffix(b"<closed>").partition(b"\r\n\r\n")
    assert b"content-type: application/problem+json" in head.lower(), head
    assert json.loads(body)["status"] == 400
