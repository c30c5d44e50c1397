"""The ``jobrelay`` command.

Every command accepts every setting as ``--option`` (``--database-url``…) next to its
``JOBRELAY_*`` variable; the option wins. A bad setting is one line on stderr naming the
variable, exit code 2, and nothing created. Long-running commands drain on SIGTERM/SIGINT.
"""

import asyncio
import functools
import inspect
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Annotated, Any, Optional, TypeVar

import typer

from jobrelay.errors import ConfigError, JobrelayError
from jobrelay.observe import logs
from jobrelay.settings import ENV_PREFIX, Settings, load_settings

app = typer.Typer(
    name="jobrelay",
    help="Background jobs that never silently disappear and never silently happen twice.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
broker_app = typer.Typer(help="Broker topology.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
job_app = typer.Typer(help="One job.", no_args_is_help=True)
jobs_app = typer.Typer(help="Many jobs.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(broker_app, name="broker")
app.add_typer(token_app, name="token")
app.add_typer(job_app, name="job")
app.add_typer(jobs_app, name="jobs")

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


def _print_version(value: bool) -> None:
    if value:
        from jobrelay import __version__

        typer.echo(f"jobrelay {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """Background jobs that never silently disappear and never silently happen twice."""


def with_settings(func: F) -> F:
    """Add one ``--option`` per setting to a command and hand it the loaded ``Settings``."""
    signature = inspect.signature(func)
    params = [p for p in signature.parameters.values() if p.name != "settings"]
    for name in _SETTINGS_FIELDS:
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
        overrides = {name: kwargs.pop(name) for name in _SETTINGS_FIELDS}
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

    ``fast_loop``: on uvloop when it is installed (the API, where the loop's socket work is
    a large share of each request), else on asyncio's own loop.
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


# --- processes -------------------------------------------------------------------------------

Port = Annotated[int, typer.Option(min=1, max=65535, help="Port to bind.")]


@app.command("api")
@with_settings
def api_cmd(
    settings: Settings,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Port = 8000,
) -> None:
    """Serve the HTTP API."""
    from jobrelay.roles.processes import serve_api

    logs.configure("api", settings.log_level)
    run_until_signalled(lambda stop: serve_api(settings, host, port, stop), fast_loop=True)


MetricsPort = Annotated[
    Optional[int],  # noqa: UP045 (typer needs it)
    typer.Option(
        min=1,
        max=65535,
        envvar="JOBRELAY_METRICS_PORT",
        help="Serve Prometheus metrics at http://HOST:PORT/metrics.",
        show_default=False,
    ),
]
MetricsHost = Annotated[
    str, typer.Option(envvar="JOBRELAY_METRICS_HOST", help="Interface for --metrics-port.")
]


def _metrics_at(host: str, port: int | None) -> Any:
    from jobrelay.roles.processes import MetricsAddress

    return MetricsAddress(host, port) if port is not None else None


@app.command("relay")
@with_settings
def relay_cmd(
    settings: Settings, metrics_port: MetricsPort = None, metrics_host: MetricsHost = "127.0.0.1"
) -> None:
    """Publish outbox rows to the broker (several may run at once), and reconcile."""
    from jobrelay.roles.processes import run_relay

    logs.configure("relay", settings.log_level)
    at = _metrics_at(metrics_host, metrics_port)
    run_until_signalled(lambda stop: run_relay(settings, stop, at))


@app.command("worker")
@with_settings
def worker_cmd(
    settings: Settings,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = "127.0.0.1",
    queue: Annotated[
        Optional[list[str]],  # noqa: UP045 (typer needs it)
        typer.Option(
            "--queue",
            help="Consume this queue (repeatable), each with its own prefetch "
            "[default: every queue of the app].",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Consume jobs and run them."""
    from jobrelay.roles.processes import run_worker

    logs.configure("worker", settings.log_level)
    at = _metrics_at(metrics_host, metrics_port)
    queues = tuple(queue or ())
    run_until_signalled(lambda stop: run_worker(settings, stop, at, queues))


@app.command("up")
@with_settings
def up_cmd(
    settings: Settings,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Port = 8000,
) -> None:
    """API + relay + worker in one process (development and the embedded default)."""
    from jobrelay.roles.processes import run_up

    logs.configure("up", settings.log_level)
    run_until_signalled(lambda stop: run_up(settings, host, port, stop))


@app.command("demo")
@with_settings
def demo_cmd(settings: Settings) -> None:
    """Run the app's demo end to end on the configured (by default embedded) pipeline."""
    demo = app_command(settings, "demo")
    logs.configure("demo", "ERROR")  # the demo narrates; faults it arms are announced
    raise typer.Exit(demo(settings))


@app.command("chaos")
def chaos_cmd(
    jobs: Annotated[int, typer.Option(min=1, help="Exports to submit.")] = 2000,
    seed: Annotated[int, typer.Option(help="Decides the whole plan; rerun a failure with it.")] = 1,
    profile: Annotated[
        str, typer.Option(help="full (make chaos) or short (the CI version): how many faults.")
    ] = "full",
    poison: Annotated[int, typer.Option(min=0, help="Jobs that fail on every attempt.")] = 3,
    concurrency: Annotated[int, typer.Option(min=1, help="Concurrent HTTP clients.")] = 8,
    rate: Annotated[
        Optional[float],  # noqa: UP045 (typer needs it)
        typer.Option(min=0.1, help="Submissions per second [default: spread over the faults]."),
    ] = None,
    settle_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for quiet after the faults.")
    ] = 240.0,
    out: Annotated[str, typer.Option(help="Where reports and process logs go.")] = "chaos-results",
    keep: Annotated[bool, typer.Option(help="Keep the database and vhost afterwards.")] = False,
    pg_server: Annotated[
        str, typer.Option(help="PostgreSQL server (a scratch database is made there).")
    ] = "postgresql://postgres@127.0.0.1:5432",
    amqp_server: Annotated[
        str, typer.Option(help="RabbitMQ server (a scratch vhost is made there).")
    ] = "amqp://guest:guest@127.0.0.1:5672",
    postgres_restart: Annotated[
        Optional[str],  # noqa: UP045 (typer needs it)
        typer.Option(help="Command that restarts PostgreSQL [default: pg_ctlcluster … restart]."),
    ] = None,
    cluster: Annotated[
        int,
        typer.Option(
            min=0,
            max=7,
            help="Start a RabbitMQ cluster of this many nodes on loopback and soak on it "
            "(2 apis, 3 relays, 4 workers; node stops instead of the broker restart).",
        ),
    ] = 0,
) -> None:
    """Soak PostgreSQL + RabbitMQ under kill -9 and restarts; check nothing lost or doubled."""
    import shlex
    from pathlib import Path

    try:
        from jobrelay.chaos.plan import PROFILES
        from jobrelay.chaos.run import ChaosOptions, run_chaos
        from jobrelay.chaos.sandbox import Services
    except ImportError as exc:
        raise fail(f"the soak needs the chaos extra ('jobrelay[chaos]'): {exc}", 2) from exc
    if profile not in PROFILES:
        raise fail(f"--profile must be one of {', '.join(PROFILES)}", 2)
    if not 0 <= poison < jobs:
        raise fail("--poison must be smaller than --jobs", 2)
    services = Services(pg_server=pg_server.rstrip("/"), amqp_server=amqp_server.rstrip("/"))
    if postgres_restart:
        services.postgres_restart = shlex.split(postgres_restart)
    logs.configure("chaos", "WARNING")
    options = ChaosOptions(
        jobs=jobs,
        seed=seed,
        profile=profile,
        poison=poison,
        concurrency=concurrency,
        rate=rate,
        settle_timeout=settle_timeout,
        out_dir=Path(out),
        keep=keep,
        services=services,
        cluster_nodes=cluster,
    )
    raise typer.Exit(run(run_chaos(options)))


def app_command(settings: Settings, name: str) -> Callable[..., int]:
    """The body of command ``name`` from the app (``--app``/``JOBRELAY_APP``)."""
    from jobrelay.loader import load_app

    command = load_app(settings.app).commands.get(name)
    if command is None:
        raise ConfigError(
            "JOBRELAY_APP", f"the app {settings.app or 'default'!r} has no {name!r} command"
        )
    return command


# --- inspection ------------------------------------------------------------------------------


@job_app.command("show")
@with_settings
def job_show_cmd(
    settings: Settings,
    job_id: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json", help="The explanation as JSON.")] = False,
) -> None:
    """State, facts, attempts and timeline of one job, and where to look next."""
    from jobrelay.cli.retention import fail_missing
    from jobrelay.ops.explain import show_job

    job_id = known_job_id(job_id)
    if not run(show_job(settings, job_id, as_json=as_json)):
        raise fail_missing(settings, job_id, f"no job {job_id}")


@jobs_app.command("list")
@with_settings
def jobs_list_cmd(
    settings: Settings,
    state: Annotated[Optional[str], typer.Option(help="Only jobs in this state.")] = None,  # noqa: UP045
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 50,
    reason: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Only jobs whose quarantine reason or last error contains this."),
    ] = None,
    job_type: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--type", help="Only jobs of this type."),
    ] = None,
) -> None:
    """Recent jobs, newest first."""
    from jobrelay.domain.states import JobState
    from jobrelay.ops.explain import list_jobs

    try:
        wanted = JobState(state) if state else None
    except ValueError:
        choices = ", ".join(s.value for s in JobState)
        raise fail(f"--state must be one of {choices}", 2) from None
    run(list_jobs(settings, wanted, limit, reason=reason, job_type=job_type))


# Set-up, operator actions, schedules, queues, the reconciler and prune live in modules of
# their own; importing them registers their commands.
from jobrelay.cli import (  # noqa: E402, F401
    database,
    operator,
    provision,
    resend,
    retention,
    schedules,
    tokens,
    work_queues,
)
