"""Staged file results published together share the directory's ``fsync`` (issue 41, item 4).

A batch's completions publish side by side inside their transaction; each rename is durable
once an ``fsync`` of its directory that started after it has ended. Old code: one ``fsync``
(and one listing of the directory for dead writers' temp files) per file.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from jobrelay.results import files
from jobrelay.results.files import STALE_TEMP_SECONDS, FileResults


class SyncLog:
    """Every ``fsync`` of a directory: what the directory held when it started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.listings: list[set[str]] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if os.path.isdir(path):
                self.listings.append(set(os.listdir(path)))
            real_fsync(fd)

        monkeypatch.setattr(files.os, "fsync", fsync)


async def staged(results: FileResults, key: str) -> files._FileSession:
    session = results.writer(key, staged=True)
    async with session as writer:
        await writer.write(f"{key}\n".encode())
    return session


async def test_a_batchs_publications_share_one_fsync_of_their_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = FileResults(f"file://{tmp_path}")
    sessions = [await staged(results, f"acme/{i}.csv") for i in range(5)]
    log = SyncLog(monkeypatch)

    await asyncio.gather(*(s.publish() for s in sessions))

    assert len(log.listings) == 1  # old code: 5
    assert {f"{i}.csv" for i in range(5)} <= log.listings[0]  # every rename before it
    assert all((tmp_path / "acme" / f"{i}.csv").read_bytes() for i in range(5))


async def test_a_rename_after_an_fsync_started_waits_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = FileResults(f"file://{tmp_path}")
    first, second = [await staged(results, f"acme/{name}.csv") for name in ("a", "b")]
    log = SyncLog(monkeypatch)

    await first.publish()
    await second.publish()

    assert len(log.listings) == 2
    assert "a.csv" in log.listings[0] and "b.csv" not in log.listings[0]
    assert "b.csv" in log.listings[1]


async def test_dead_writers_temp_files_are_removed_live_ones_kept(tmp_path: Path) -> None:
    results = FileResults(f"file://{tmp_path}")
    session = await staged(results, "acme/r.csv")
    dead = tmp_path / "acme" / ".r.csv.dead.tmp"
    live = tmp_path / "acme" / ".r.csv.live.tmp"
    for temp in (dead, live):
        temp.write_bytes(b"partial")
    old = time.time() - STALE_TEMP_SECONDS - 60
    os.utime(dead, (old, old))

    await session.publish()

    assert not dead.exists() and live.exists()
    assert (tmp_path / "acme" / "r.csv").read_bytes() == b"acme/r.csv\n"


async def test_a_writer_stopped_while_its_file_opens_leaves_no_handle_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run cancelled (a lost lease) while the thread opens its temp file: the thread still
    opens it, and that handle is closed and the file removed (CI: the handle was left to
    the garbage collector, a ``ResourceWarning``, and the temp file to the sweep)."""
    results = FileResults(f"file://{tmp_path}")
    inside, release = threading.Event(), threading.Event()
    opened: list[Any] = []
    real_create = files._create_private

    def slow_create(path: Path) -> Any:
        inside.set()
        release.wait(10)
        handle = real_create(path)
        opened.append(handle)
        return handle

    abandoned = asyncio.Event()
    real_abandon = getattr(files, "_abandon", None)

    def abandon(temp: Path, opening: Any) -> None:
        assert real_abandon is not None
        real_abandon(temp, opening)
        abandoned.set()

    monkeypatch.setattr(files, "_create_private", slow_create)
    monkeypatch.setattr(files, "_abandon", abandon, raising=False)
    session = results.writer("acme/r.csv", staged=True)
    entering = asyncio.ensure_future(session.__aenter__())
    assert await asyncio.to_thread(inside.wait, 10)
    entering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await entering
    release.set()
    await asyncio.wait_for(abandoned.wait(), 10)
    assert len(opened) == 1 and opened[0].closed
    assert list((tmp_path / "acme").iterdir()) == []
