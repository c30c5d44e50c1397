"""``jobrelay chaos``: set up, run the clients and the fault controller, settle, check, report.

The run, in order:

1. a sandbox (fresh database, vhost and bucket), moto's S3 and the recording SMTP server in
   this process; ``db upgrade``, ``broker declare``, ``seed`` and one token per account
   through the real CLI;
2. the processes: one api, two relays, two workers, each supervised; every worker carries a
   permanent fault that makes the poison jobs fail on every attempt. With ``--cluster N`` the
   soak first starts its own N-node RabbitMQ cluster, runs two apis, three relays and four
   workers against all its nodes, and replaces the broker restart with node stops and starts
   (``broker_faults.py``);
3. clients submit the planned exports over HTTP while the controller works through the
   seeded fault plan (kills, a crash at every fault point, a RabbitMQ and a PostgreSQL
   restart);
4. when both are done, wait until nothing moves (every job terminal, outbox empty, work and
   retry queues empty) or the settle timeout passes;
5. read the database, bucket, mail sink and broker, judge (``verdict.judge``), print the
   table and the one-line summary, write the JSON report; exit 1 on any violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from datetime import UTC, datetime

import httpx
from aiobotocore.session import get_session
from rich.console import Console
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.chaos.broker_faults import NodeFaults
from jobrelay.chaos.clients import Clients, Pacer, Record
from jobrelay.chaos.cluster import Cluster, Role
from jobrelay.chaos.limited_app import ACCOUNT_LIMIT
from jobrelay.chaos.limited_app import SPEC as LIMITED_APP
from jobrelay.chaos.options import ChaosOptions
from jobrelay.chaos.pg_pair import PairError, PostgresPair
from jobrelay.chaos.plan import (
    POISON_ACCOUNT,
    POISON_PERIOD,
    PROFILES,
    Fault,
    Plan,
    fault_steps,
    make_plan,
)
from jobrelay.chaos.rabbit_cluster import ClusterError, RabbitCluster
from jobrelay.chaos.report import FaultLog, failover_line, object_versions, print_table
from jobrelay.chaos.report import report as make_report
from jobrelay.chaos.report import world as read_world
from jobrelay.chaos.sandbox import ChaosSetupError, Sandbox
from jobrelay.chaos.sinks import MailServer, S3Server, free_port
from jobrelay.chaos.verdict import Verdict, judge, summary_line
from jobrelay.storage import audit
from jobrelay.storage.engine import create_engine
from jobrelay.storage.store import Store
from jobrelay.transport.topology import QUARANTINE_QUEUE

console = Console(stderr=True, highlight=False, width=120)
MAIL_FROM = "jobrelay@example.com"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "chaos",
    "AWS_SECRET_ACCESS_KEY": "chaos",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# Short leases and fast reconciling, so recovery happens within the soak; what each one means
# is in docs/reference/settings.md. Every worker death costs the jobs it was running an
# attempt (that is how a crash loop ends), and the soak kills workers every few seconds, far
# more often than production; five attempts keep healthy jobs out of quarantine, poison jobs
# still use them all up.
TUNING = {
    "JOBRELAY_MAX_ATTEMPTS": "5",
    "JOBRELAY_LEASE_SECONDS": "3",
    "JOBRELAY_RETRY_DELAYS": "1,2",
    "JOBRELAY_RELAY_POLL_SECONDS": "0.2",
    "JOBRELAY_RELAY_CLAIM_SECONDS": "5",
    "JOBRELAY_CONFIRM_TIMEOUT": "5",
    "JOBRELAY_RECONCILE_SECONDS": "5",
    "JOBRELAY_RECONCILE_GRACE_SECONDS": "10",
    "JOBRELAY_LOG_LEVEL": "INFO",
    # The clients submit as fast as the cluster accepts, from one token per account.
    "JOBRELAY_RATE_LIMIT": "off",
}


async def run_chaos(opts: ChaosOptions) -> int:
    """The whole soak; the process exit code (0 clean, 1 a violation, 2 could not run)."""
    # SIGTERM (and Ctrl-C) cancel the soak, so the ``finally`` below stops every process,
    # the soak's RabbitMQ nodes and the scratch services on that exit path too.
    me = asyncio.current_task()
    if me is not None:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, me.cancel)
    started = time.monotonic()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    root = (opts.out_dir / f"chaos-{opts.seed}-{stamp}").resolve()
    sandbox = Sandbox(opts.services, root)
    apis, relays, workers = opts.layout
    plan = make_plan(
        opts.seed,
        opts.jobs,
        opts.poison,
        PROFILES[opts.profile],
        workers,
        relays,
        ",".join(apis),
        rabbit_nodes=opts.cluster_nodes,
        failovers=opts.failovers,
    )
    console.print(
        f"chaos: seed={opts.seed} jobs={opts.jobs} poison={opts.poison} profile={opts.profile}"
        f" cluster={opts.cluster_nodes or 'no'}"
        f" limits={f'{ACCOUNT_LIMIT} per account' if opts.limits else 'off'}"
        f" failovers={opts.failovers or 'no'}{'' if opts.synchronous_standby else ' (async)'}"
        f" run={sandbox.run_id}; logs in {sandbox.log_dir}"
    )
    for line in plan.describe():
        console.print(f"  plan: {line}")
    for name, value in AWS_ENV.items():
        os.environ.setdefault(name, value)
    s3, mail = S3Server(), MailServer()
    cluster: Cluster | None = None
    verdict: Verdict | None = None
    rabbit: RabbitCluster | None = None
    try:
        if opts.cluster_nodes:
            rabbit = RabbitCluster(opts.cluster_nodes, logs_to=root / "rabbitmq-logs")
            console.print(f"starting a {opts.cluster_nodes}-node RabbitMQ cluster")
            try:
                await asyncio.to_thread(rabbit.start)
            except ClusterError as exc:
                raise ChaosSetupError(f"RabbitMQ cluster: {exc}") from None
            opts.services.cluster = rabbit
        nodes = NodeFaults(rabbit, sandbox.vhost) if rabbit else None
        if opts.failovers:
            synchronous = "synchronous" if opts.synchronous_standby else "asynchronous"
            console.print(f"starting a PostgreSQL primary and {synchronous} standby")
            try:
                pair = await asyncio.to_thread(PostgresPair, synchronous=opts.synchronous_standby)
            except PairError as exc:
                raise ChaosSetupError(f"PostgreSQL primary and standby: {exc}") from None
            opts.services.pair = pair
            opts.services.pg_server = pair.server_url
        await sandbox.create()
        s3.start()
        mail.start()
        await _create_bucket(s3.endpoint, sandbox.bucket)
        api_ports = {name: free_port() for name in apis}
        env = _role_env(sandbox, s3, mail, next(iter(api_ports.values())), opts.limits)
        tokens = await _prepare(env, sandbox)
        cluster = Cluster(_roles(api_ports, relays, workers), env, sandbox.log_dir)
        await cluster.start()
        bases = [f"http://127.0.0.1:{port}" for port in api_ports.values()]
        for base in bases:
            await _wait_ready(base, cluster)
        # Submissions are spread over the whole fault plan, each fault's share released as
        # it begins, so every fault lands on live work (or at a fixed rate, with --rate).
        steps = [opts.jobs / opts.rate] if opts.rate else fault_steps(plan)
        clients = Clients(
            bases,
            tokens,
            concurrency=opts.concurrency,
            pace=Pacer(steps, opts.jobs),
            patience=opts.settle_timeout / 2,
        )
        engine = create_engine(sandbox.database_url)
        try:
            records, faults = await _soak(opts, plan, cluster, clients, sandbox, engine, nodes)
            quiet = await _settle(engine, sandbox, opts.settle_timeout)
            world = await read_world(s3, mail, sandbox, faults)
            facts = await audit.collect(Store(engine))
        finally:
            await engine.dispose()
        verdict = judge(records, facts, world, ACCOUNT_LIMIT if opts.limits else None)
        elapsed = time.monotonic() - started
        line = summary_line(opts.seed, verdict, elapsed, len(faults))
        report = make_report(opts, plan, sandbox, records, faults, cluster, verdict, quiet, elapsed)
        report["versions"] = await object_versions(s3.endpoint, sandbox.bucket)
        report["summary"] = line
        report["rabbit_nodes"] = [n.name for n in rabbit.nodes] if rabbit else []
        report_path = root / "report.json"
        report_path.write_text(json.dumps(report, indent=2, default=str))
        print_table(verdict, faults, cluster, quiet)
        console.print(f"report: {report_path}")
        moved = failover_line(verdict, faults, cluster.exits)
        if moved is not None:
            report["failover"] = moved
            report_path.write_text(json.dumps(report, indent=2, default=str))
            print(moved, flush=True)
        print(line, flush=True)
        return 0 if verdict.ok else 1
    except ChaosSetupError as exc:
        console.print(f"[red]chaos: could not run: {exc}[/red]")
        return 2
    except asyncio.CancelledError:
        console.print("[red]chaos: stopped before a verdict (SIGTERM or Ctrl-C)[/red]")
        return 2
    finally:
        if cluster is not None:
            await cluster.stop()
        mail.stop()
        s3.stop()
        if opts.keep or (verdict is not None and not verdict.ok):
            console.print(f"kept for inspection: database and vhost {sandbox.database}")
        else:
            for problem in await sandbox.destroy():
                console.print(f"[yellow]cleanup: {problem}[/yellow]")
        if rabbit is not None:  # on every exit path: the cluster is this run's alone
            await asyncio.to_thread(rabbit.stop)
            opts.services.cluster = None
        if opts.services.pair is not None:  # as the cluster: this run's alone
            await asyncio.to_thread(opts.services.pair.remove)
            opts.services.pair = None


def _role_env(
    sandbox: Sandbox, s3: S3Server, mail: MailServer, api_port: int, limits: bool
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBRELAY_")}
    env.update(AWS_ENV)
    env.update(TUNING)
    if limits:
        env["JOBRELAY_APP"] = LIMITED_APP
    env.update(
        {
            "JOBRELAY_DATABASE_URL": sandbox.database_url,
            "JOBRELAY_BROKER_URL": sandbox.broker_url,
            "JOBRELAY_RESULTS_URL": f"s3://{sandbox.bucket}/jobrelay",
            "JOBRELAY_S3_ENDPOINT_URL": s3.endpoint,
            "JOBRELAY_SMTP_URL": mail.url,
            "JOBRELAY_MAIL_FROM": MAIL_FROM,
            "JOBRELAY_PUBLIC_URL": f"http://127.0.0.1:{api_port}",
        }
    )
    return env


def _roles(
    api_ports: dict[str, int], relays: tuple[str, ...], workers: tuple[str, ...]
) -> list[Role]:
    poison = f"export.run:transient@accountId={POISON_ACCOUNT}&period={POISON_PERIOD}"
    return [
        *(
            Role(name, ["api", "--host", "127.0.0.1", "--port", str(port)])
            for name, port in api_ports.items()
        ),
        *(Role(name, ["relay"]) for name in relays),
        *(Role(name, ["worker"], permanent_faults=poison) for name in workers),
    ]


async def _prepare(env: dict[str, str], sandbox: Sandbox) -> dict[str, str]:
    """Schema, topology, ledger data and one token per account, through the real CLI."""
    log = sandbox.log_dir / "setup.log"

    async def cli(*args: str) -> str:
        argv = [sys.executable, "-m", "jobrelay", *args]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
        )
        out, err = await proc.communicate()
        with log.open("a") as f:
            f.write(f"$ jobrelay {' '.join(args)}\n{err.decode(errors='replace')}\n")
        if proc.returncode != 0:
            raise ChaosSetupError(f"`jobrelay {' '.join(args)}` failed: {err.decode()[-800:]}")
        return out.decode()

    await cli("db", "upgrade")
    await cli("broker", "declare")
    await cli("seed")
    tokens = {}
    for account in ("acme", "globex", "initech"):
        tokens[account] = (await cli("token", "create", "--account", account)).splitlines()[-1]
    return tokens


async def _create_bucket(endpoint: str, bucket: str) -> None:
    async with get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1"
    ) as client:
        await client.create_bucket(Bucket=bucket)
        # Versioning makes every write of a key visible, so rewrites by retries can be counted.
        await client.put_bucket_versioning(
            Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}
        )


async def _wait_ready(base: str, cluster: Cluster, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{base}/readyz")).status_code == 200:
                    return
            await asyncio.sleep(0.2)
    exits = ", ".join(f"{e.role}:{e.code}" for e in cluster.exits)
    raise ChaosSetupError(f"the api did not become ready within {timeout:g}s (exits: {exits})")


async def _soak(
    opts: ChaosOptions,
    plan: Plan,
    cluster: Cluster,
    clients: Clients,
    sandbox: Sandbox,
    engine: AsyncEngine,
    nodes: NodeFaults | None,
) -> tuple[list[Record], list[FaultLog]]:
    faults: list[FaultLog] = []
    done = asyncio.Event()

    async def controller() -> None:
        for step, fault in enumerate(plan.faults):
            await clients.pace.begin(step)
            await asyncio.sleep(fault.pause)  # the plan's spacing between faults
            faults.append(await _inject(fault, cluster, sandbox, opts.crash_timeout, nodes))
            entry = faults[-1]
            console.print(
                f"  [{entry.at:6.1f}s] {entry.kind} {entry.target}"
                f"{' ' + entry.point if entry.point else ''}: {entry.result}"
                f"{' (' + entry.detail + ')' if entry.detail else ''}"
            )

    async def progress() -> None:
        while not done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), 5)
            outcomes = [r.outcome for r in clients.records if r.requests]
            moving = unpublished = -1
            with contextlib.suppress(Exception):
                moving, unpublished = await audit.non_terminal_and_unpublished(engine)
            console.print(
                f"  [{cluster.elapsed():6.1f}s] submitted {len(outcomes)}/{len(plan.submissions)}"
                f" ok={outcomes.count('ok')} moving={moving} unpublished={unpublished}"
                f" faults={len(faults)}/{len(plan.faults)} exits={len(cluster.exits)}"
            )

    ticker = asyncio.create_task(progress())
    try:
        records, _ = await asyncio.gather(clients.run(plan.submissions), controller())
    finally:
        done.set()
        await ticker
    return records, faults


async def _inject(
    fault: Fault,
    cluster: Cluster,
    sandbox: Sandbox,
    crash_timeout: float,
    nodes: NodeFaults | None = None,
) -> FaultLog:
    at = cluster.elapsed()
    log = sandbox.log_dir / "faults.log"
    try:
        if fault.kind == "kill":
            for _ in range(40):  # the target may be between incarnations for a moment
                pid = await cluster.kill9(fault.target)
                if pid is not None:
                    return FaultLog(fault.kind, fault.target, None, at, cluster.elapsed() - at,
                                    "done", f"pid {pid}")  # fmt: skip
                await asyncio.sleep(0.25)
            return FaultLog(fault.kind, fault.target, None, at, 0, "missed", "never running")
        if fault.kind == "crash":
            assert fault.point is not None
            fired = await cluster.crash_at(fault.target.split(","), fault.point, crash_timeout)
            result = "fired" if fired else "missed"
            detail = (
                f"{fired.role} incarnation {fired.incarnation}"
                if fired
                else "never reached the point"
            )
            return FaultLog(fault.kind, fault.target, fault.point, at, cluster.elapsed() - at,
                            result, detail)  # fmt: skip
        if fault.kind in ("node_stop", "node_start"):
            if nodes is None:
                raise ChaosSetupError("node faults need --cluster")
            done = await nodes.inject(fault.kind, fault.target)
            return FaultLog(fault.kind, fault.target, None, at, cluster.elapsed() - at, "done",
                            done)  # fmt: skip
        if fault.kind == "postgres_failover":
            services = sandbox.services

            async def fail_over() -> str:
                return await services.fail_over_postgres(sandbox.database)

            if fault.point is None:
                done = await fail_over()
                return FaultLog(fault.kind, fault.target, None, at, cluster.elapsed() - at,
                                "done", done)  # fmt: skip
            held, detail = await cluster.stall_at(
                fault.target.split(","), fault.point, crash_timeout, fail_over
            )
            result = "fired" if held else "missed"
            if held:
                detail = f"{held} held at the point; {detail}"
            return FaultLog(fault.kind, fault.target, fault.point, at, cluster.elapsed() - at,
                            result, detail)  # fmt: skip
        if fault.kind == "rabbitmq_restart":
            await sandbox.services.restart_rabbitmq(log)
        else:
            await sandbox.services.restart_postgres(log)
        return FaultLog(fault.kind, fault.target, None, at, cluster.elapsed() - at, "done")
    except ChaosSetupError as exc:
        return FaultLog(fault.kind, fault.target, fault.point, at, cluster.elapsed() - at,
                        "missed", str(exc)[:300])  # fmt: skip


async def _settle(engine: AsyncEngine, sandbox: Sandbox, timeout: float) -> float | None:
    """Seconds until nothing moved (twice in a row), or None if the timeout passed first."""
    started = time.monotonic()
    quiet_polls = 0
    while time.monotonic() - started < timeout:
        try:
            moving, unpublished = await audit.non_terminal_and_unpublished(engine)
            depths = await sandbox.queue_depths()
        except Exception:  # a service still coming back: ask again
            moving, unpublished, depths = 1, 0, {}
        busy = sum(n for q, n in depths.items() if q != QUARANTINE_QUEUE)
        quiet_polls = quiet_polls + 1 if moving == 0 and unpublished == 0 and busy == 0 else 0
        if quiet_polls >= 2:
            return time.monotonic() - started
        await asyncio.sleep(1)  # polling the system's state, with a deadline
    console.print(f"[red]not quiet after {timeout:g}s[/red]")
    return None
