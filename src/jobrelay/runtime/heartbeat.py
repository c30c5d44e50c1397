"""A worker's or relay's heartbeat: its row in ``process_heartbeats`` while it runs.

Best effort by design: a beat that fails (the database is away) is logged and the next one
tries again; nothing on the job path waits for it or depends on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence

from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.heartbeats import ProcessBeat, beat

log = logging.getLogger("jobrelay.heartbeat")


@contextlib.asynccontextmanager
async def heartbeat(
    rt: Runtime, process_id: str, role: str, queues: Sequence[str] = ()
) -> AsyncIterator[None]:
    """Beat every ``JOBRELAY_HEARTBEAT_SECONDS`` inside the block; the first beat at once."""
    process = ProcessBeat(
        id=process_id,
        role=role,
        host=socket.gethostname(),
        pid=os.getpid(),
        queues=tuple(queues),
        started_at=rt.clock(),
        last_seen_at=rt.clock(),
    )

    async def loop() -> None:
        while True:
            try:
                await beat(rt.store, process, rt.clock())
            except Exception as exc:  # the beat is advisory: never let it end the process
                log.debug("heartbeat failed: %s", exc, extra={"event": "heartbeat_failed"})
            await asyncio.sleep(rt.settings.heartbeat_seconds)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
