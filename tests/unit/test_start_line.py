"""``jobrelay up``'s one human line: the bound port (0 picks one), the job types the app
runs, and no password from either URL."""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel

from jobrelay.library.app import App
from jobrelay.processes.entry_points import start_line
from jobrelay.settings import Settings


def test_the_start_line_names_the_bound_port_the_types_and_hides_passwords() -> None:
    class Order(BaseModel):
        order_id: int

    app = App()

    @app.job("orders.fulfil", params=Order)
    async def fulfil(ctx: Any, params: Order) -> None:
        return None

    settings = Settings(
        app="shop.jobs:app",
        database_url="postgresql://shop:db-secret@db.internal/shop",
        broker_url="amqp://shop:mq-secret@mq.internal/shop",
    )
    runtime: Any = SimpleNamespace(job_app=lambda: app)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        line = start_line(settings, runtime, sock)
    assert line == (
        f"jobrelay up: listening on http://127.0.0.1:{port} (console "
        f"http://127.0.0.1:{port}/console, API docs http://127.0.0.1:{port}/docs); "
        "app shop.jobs:app (orders.fulfil); database postgresql://shop:***@db.internal/shop; "
        "RabbitMQ amqp://shop:***@mq.internal/shop; Ctrl-C stops"
    )
