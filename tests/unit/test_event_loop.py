"""The long-running commands run on uvloop when it is installed (cli/common.py), as the API
did already: the relay, the worker and ``up`` spend much of each job in the event loop's
own work. Without uvloop they run on asyncio's loop."""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvloop
from typer.testing import CliRunner

from jobrelay.cli import common

main = importlib.import_module("jobrelay.cli.main")  # the package's ``main`` is a function


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("command", ["api", "relay", "worker", "up"])
def test_each_long_running_command_asks_for_the_fast_loop(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[bool] = []

    def run_until_signalled(
        run: Callable[[asyncio.Event], Any], *, fast_loop: bool = False
    ) -> None:
        asked.append(fast_loop)

    monkeypatch.setattr(main, "run_until_signalled", run_until_signalled)
    result = CliRunner().invoke(main.app, [command])
    assert result.exit_code == 0, result.output
    assert asked == [True]


def _loop_of_a_run(fast_loop: bool) -> type[asyncio.AbstractEventLoop]:
    seen: list[type[asyncio.AbstractEventLoop]] = []

    async def run(stop: asyncio.Event) -> None:
        seen.append(type(asyncio.get_running_loop()))

    common.run_until_signalled(run, fast_loop=fast_loop)
    return seen[0]


def test_the_fast_loop_is_uvloop_when_installed_else_asyncios(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert issubclass(_loop_of_a_run(True), uvloop.Loop)
    assert not issubclass(_loop_of_a_run(False), uvloop.Loop)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: import fails
    assert not issubclass(_loop_of_a_run(True), uvloop.Loop)
