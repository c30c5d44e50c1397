"""The ``jobrelay`` command.

Every command accepts every setting as ``--option`` (``--database-url``…) next to its
``JOBRELAY_*`` variable, unless the command has an option of that name of its own (``limits
set --concurrency``); the option wins. A bad setting is one line on stderr naming the
variable, exit code 2, and nothing created. Long-running commands drain on SIGTERM/SIGINT.
"""

from typing import Annotated, Any, Optional

import typer

from jobrelay.cli import (
    database,
    inspection,
    limits,
    operator,
    provision,
    resend,  # noqa: F401 (registers job resend on inspection.job_app)
    retention,
    schedules,
    tokens,
    work_queues,
)
from jobrelay.cli.common import (  # noqa: F401 (re-exported for the tests and the app loader)
    app_command,
    fail,
    known_job_id,
    run,
    run_until_signalled,
    with_settings,
)
from jobrelay.observe import logs
from jobrelay.observe.setup import observe
from jobrelay.settings import Settings

app = typer.Typer(
    name="jobrelay",
    help="Background jobs that never silently disappear and never silently happen twice.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


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
    from jobrelay.processes.entry_points import serve_api

    observe("api", settings)
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
    from jobrelay.processes.entry_points import MetricsAddress

    return MetricsAddress(host, port) if port is not None else None


@app.command("relay")
@with_settings
def relay_cmd(
    settings: Settings, metrics_port: MetricsPort = None, metrics_host: MetricsHost = "127.0.0.1"
) -> None:
    """Publish outbox rows to the broker (several may run at once), and reconcile."""
    from jobrelay.processes.entry_points import run_relay

    observe("relay", settings)
    at = _metrics_at(metrics_host, metrics_port)
    run_until_signalled(lambda stop: run_relay(settings, stop, at), fast_loop=True)


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
    from jobrelay.processes.entry_points import run_worker

    observe("worker", settings)
    at = _metrics_at(metrics_host, metrics_port)
    queues = tuple(queue or ())
    run_until_signalled(lambda stop: run_worker(settings, stop, at, queues), fast_loop=True)


@app.command("up")
@with_settings
def up_cmd(
    settings: Settings,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Port = 8000,
) -> None:
    """API + relay + worker in one process (development and the embedded default)."""
    from jobrelay.processes.entry_points import run_up

    observe("up", settings)
    run_until_signalled(lambda stop: run_up(settings, host, port, stop), fast_loop=True)


@app.command("demo")
@with_settings
def demo_cmd(settings: Settings) -> None:
    """Run the app's demo end to end on the configured (by default embedded) pipeline."""
    demo = app_command(settings, "demo")
    observe("demo", settings, "ERROR")  # the demo narrates; faults it arms are announced
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
    rabbitmq_node: Annotated[
        Optional[str],  # noqa: UP045 (typer needs it)
        typer.Option(
            help="RabbitMQ node to restart (rabbitmqctl -n) [default: the machine's own node]."
        ),
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
    limits: Annotated[
        bool,
        typer.Option(
            help="Run the exports under a concurrency limit per account (jobrelay.chaos."
            "limited_app) and check it held; --no-limits: the shipped app, unlimited."
        ),
    ] = True,
    failover: Annotated[
        bool,
        typer.Option(
            help="Start a PostgreSQL primary and synchronous standby of its own (initdb, "
            "pg_basebackup; never the machine's), give every process both hosts, and fail "
            "over under load instead of restarting PostgreSQL, back and forth, once at each "
            "hand-off (a process held there meanwhile)."
        ),
    ] = False,
    async_standby: Annotated[
        bool,
        typer.Option(
            help="With --failover: an asynchronous standby, to see what the last commits "
            "before a failover become (a loss is then reported, not hidden)."
        ),
    ] = False,
) -> None:
    """Soak PostgreSQL + RabbitMQ under kill -9 and restarts; check nothing lost or doubled.

    By default it restarts the machine's PostgreSQL (pg_ctlcluster) and RabbitMQ application:
    every other client of those servers loses its connections. Point --pg-server,
    --postgres-restart, --amqp-server and --rabbitmq-node at servers of your own (as the tests
    do) to leave the machine's alone.
    """
    import shlex
    from pathlib import Path

    try:
        from jobrelay.chaos.options import ChaosOptions
        from jobrelay.chaos.plan import FAILOVER_POINTS, PROFILES
        from jobrelay.chaos.run import run_chaos
        from jobrelay.chaos.sandbox import Services
    except ImportError as exc:
        raise fail(f"the soak needs the chaos extra ('jobrelay[chaos]'): {exc}", 2) from exc
    if profile not in PROFILES:
        raise fail(f"--profile must be one of {', '.join(PROFILES)}", 2)
    if not 0 <= poison < jobs:
        raise fail("--poison must be smaller than --jobs", 2)
    if async_standby and not failover:
        raise fail("--async-standby goes with --failover", 2)
    services = Services(pg_server=pg_server.rstrip("/"), amqp_server=amqp_server.rstrip("/"))
    if postgres_restart:
        services.postgres_restart = shlex.split(postgres_restart)
    services.rabbitmq_node = rabbitmq_node
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
        limits=limits,
        failovers=len(FAILOVER_POINTS) if failover else 0,
        synchronous_standby=not async_standby,
    )
    raise typer.Exit(run(run_chaos(options)))


# Set-up, operator actions, schedules, queues, the reconciler and prune live in modules of
# their own, each with its own Typer app; main mounts them (the groups under their names,
# the top-level commands of a module without one).
app.add_typer(database.db_app, name="db")
app.add_typer(provision.broker_app, name="broker")
app.add_typer(tokens.token_app, name="token")
app.add_typer(inspection.job_app, name="job")
app.add_typer(inspection.jobs_app, name="jobs")
for commands in (
    provision.app,
    operator.app,
    retention.app,
    schedules.app,
    work_queues.app,
    limits.app,
):
    app.add_typer(commands)
