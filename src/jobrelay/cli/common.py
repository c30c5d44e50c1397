"""What every ``jobrelay`` command module uses: one-line failures, ``--option`` per setting,
running a coroutine and draining on a signal.

The command modules (``main`` and the sub-command modules it mounts) import from here and
never from each other's parents, so the imports point one way: ``entry`` -> ``main`` ->
sub-command modules -> ``common``.
"""

import asyncio
import functools
import inspect
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Annotated, Any, Optional, TypeVar

import typer

from jobrelay.errors import ConfigError, JobrelayError
from jobrelay.settings import ENV_PREFIX, Settings, load_settings

F = TypeVar("F", bound=Callable[..., Any])
_SETTINGS_FIELDS = tuple(Settings.model_fields)


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"jobrelay: error: {message}", err=True)
    return typer.Exit(code)


def known_job_id(raw: str) -> str:
    """``raw`` as the API reads a path's jobId (the hyphenated UUID, either case), or the
    same one line as for a job that does not exist."""
    from jobrelay.domain.ids import canonical_job_id

    job_id = canonical_job_id(raw)
    if job_id is None:
        raise fail(f"no job {raw}")
    return job_id


def with_settings(func: F) -> F:
    """Add one ``--option`` per setting to a command and hand it the loaded ``Settings``.

    A setting whose name the command takes as its own option (``limits set --concurrency``:
    a limit's, not the worker's ``JOBRELAY_CONCURRENCY``) is read from the environment only.
    """
    signature = inspect.signature(func)
    params = [p for p in signature.parameters.values() if p.name != "settings"]
    fields = [name for name in _SETTINGS_FIELDS if name not in signature.parameters]
    for name in fields:
        option = typer.Option(
            "--" + name.replace("_", "-"),
            help=f"Overrides {ENV_PREFIX}{name.upper()}.",
            show_default=False,
            rich_help_panel="Settings",
        )
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[Optional[str], option],  # noqa: UP045 (typer needs it)
            )
        )

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        overrides = {name: kwargs.pop(name) for name in fields}
        try:
            settings = load_settings(**overrides)
        except ConfigError as exc:
            raise fail(str(exc), 2) from None
        try:
            return func(*args, settings=settings, **kwargs)
        except ConfigError as exc:
            raise fail(str(exc), 2) from None
        except JobrelayError as exc:
            raise fail(str(exc)) from None

    wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper  # type: ignore[return-value]


def run_until_signalled(
    main: Callable[[asyncio.Event], Awaitable[None]], *, fast_loop: bool = False
) -> None:
    """Run ``main(stop)``; SIGTERM/SIGINT set ``stop`` so it can drain, a second one aborts.

    ``fast_loop``: on uvloop when it is installed, else on asyncio's own loop. The API, the
    relay, the worker and ``up`` ask for it: the loop's own work (sockets, timers, task
    switches) is a large share of each request and of each job.
    """

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():
                raise SystemExit(130)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await main(stop)

    with asyncio.Runner(loop_factory=_fast_loop_factory() if fast_loop else None) as loop_runner:
        loop_runner.run(runner())


def _fast_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def app_command(settings: Settings, name: str) -> Callable[..., int]:
    """The body of command ``name`` from the app (``--app``/``JOBRELAY_APP``)."""
    from jobrelay.library.loader import load_app

    command = load_app(settings.app).commands.get(name)
    if command is None:
        raise ConfigError(
            "JOBRELAY_APP", f"the app {settings.app or 'default'!r} has no {name!r} command"
        )
    return command
