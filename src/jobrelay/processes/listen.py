"""The API's listening socket, bound before anything else starts.

uvicorn binds inside its own start-up and, when that fails, logs the error and calls
``sys.exit`` from a task, which a process that also runs a relay and a worker (``up``) sees
as a traceback after a half-started service. Binding first, here, makes a port in use, a
port out of range or a host that does not resolve one line naming the option to change
(``jobrelay: error: --port: …``, exit code 2) before the database or the broker is touched.
"""

from __future__ import annotations

import errno
import socket

from jobrelay.errors import ConfigError

PORT_RANGE = (1, 65535)


def listen_socket(
    host: str, port: int, *, host_option: str = "--host", port_option: str = "--port"
) -> socket.socket:
    """A bound TCP socket for ``host:port`` (its server calls ``listen``), or ConfigError
    naming the option to change."""
    low, high = PORT_RANGE
    if not low <= port <= high:
        raise ConfigError(port_option, f"{port} is not a port ({low} to {high})")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(host_option, f"cannot listen on {host!r}: {_reason(exc)}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn does: a restarted API may bind while the old one's sockets linger.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        where = f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(port_option, f"{where} is in use by another process") from None
        option = port_option if exc.errno == errno.EACCES else host_option
        raise ConfigError(option, f"cannot listen on {where}: {_reason(exc)}") from None
    sock.set_inheritable(True)
    return sock


def _reason(exc: OSError | UnicodeError) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__
