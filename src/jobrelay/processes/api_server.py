"""The API's HTTP server: uvicorn on the guarded httptools protocol, drained by our signals.

Apart from ``processes.entry_points`` so that the worker and the relay, which serve no HTTP API,
do not import uvicorn and httptools on their way to being ready (issue 23, item 8); only
``jobrelay api``, ``up`` and ``demo`` come here.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from jobrelay.processes.http_guard import HeadLimits, guarded_protocol
from jobrelay.processes.listen import listen_socket
from jobrelay.runtime.wiring import Runtime

# How long an idle keep-alive connection stays open. uvicorn's default (5 s) equals httpx's
# and many clients' own idle expiry (5 s), so a client could send a request on a connection
# just as the server closed it: the request is lost and the client sees a reset (the
# benchmark's ReadError). The server must outlast every client's and proxy's idle timeout
# (AWS ALB 60 s, nginx upstream keepalive_timeout 60 s), never race it.
KEEP_ALIVE_SECONDS = 75


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: our handler drains relay and worker first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_server(rt: Runtime, host: str, port: int) -> _Server:
    from jobrelay.api.factory import create_app

    settings = rt.settings
    app = create_app(settings, runtime=rt)
    proxies = [p.strip() for p in settings.trusted_proxies.split(",") if p.strip()]
    limits = HeadLimits(
        max_head_bytes=settings.api_max_head_bytes,
        head_timeout=settings.api_head_timeout_seconds,
        max_connections=settings.api_max_connections,
        body_timeout=settings.api_body_timeout_seconds,
        write_timeout=settings.api_write_timeout_seconds,
        max_per_address=settings.api_max_connections_per_address,
        **HeadLimits.uncapping(proxies),
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        # httptools, with the head size, the deadlines and the connection caps it lacks.
        http=guarded_protocol(limits),
        # Which server and version answers is nobody's business but the operator's.
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        # uvicorn believes X-Forwarded-* from 127.0.0.1 by default: only from the proxies
        # the operator named (JOBRELAY_TRUSTED_PROXIES), and from nobody without one.
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies or None,
    )
    return _Server(config)


async def serve_until(
    server: _Server, stop: asyncio.Event, sock: socket.socket | None = None
) -> None:
    """Serve on ``sock`` (bound by ``listen_socket``; bound here when not given) until
    ``stop``."""
    if sock is None:
        sock = listen_socket(server.config.host, server.config.port)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopping.cancel()
    await task
    if not server.started:
        raise SystemExit(
            f"jobrelay: error: could not serve on {server.config.host}:"
            f"{server.config.port} (see the log above)"
        )
