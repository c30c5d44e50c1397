"""What the soak found, read back from the world and written down: the JSON report and the
tables printed at the end. The judging itself is ``verdict.py``; this module only gathers what
it judges (objects, mails, queues, dead letters) and shows the outcome.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from aiobotocore.session import get_session
from rich.console import Console
from rich.table import Table

from jobrelay.chaos.clients import Record
from jobrelay.chaos.cluster import Cluster, Exit
from jobrelay.chaos.plan import Plan
from jobrelay.chaos.sandbox import Sandbox
from jobrelay.chaos.sinks import MailServer, S3Server
from jobrelay.chaos.verdict import Mail, Verdict, World, as_json
from jobrelay.maintenance.quarantine_scan import browse_rabbitmq

if TYPE_CHECKING:
    from jobrelay.chaos.options import ChaosOptions

console = Console(stderr=True, highlight=False, width=120)


@dataclass
class FaultLog:
    kind: str
    target: str
    point: str | None
    at: float
    took: float
    result: str  # done | fired | missed
    detail: str = ""


async def world(s3: S3Server, mail: MailServer, sandbox: Sandbox, faults: list[FaultLog]) -> World:
    keys: list[str] = []
    async with get_session().create_client(
        "s3", endpoint_url=s3.endpoint, region_name="us-east-1"
    ) as client:
        paginator = client.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=sandbox.bucket):
            keys += [o["Key"] for o in page.get("Contents", [])]
        uploads = await client.list_multipart_uploads(Bucket=sandbox.bucket)
    mails = tuple(Mail(str(m.message["Message-ID"]), tuple(m.rcpt_tos)) for m in mail.messages)
    counts = await sandbox.queue_counts()
    dead = await browse_rabbitmq(sandbox.broker_url, limit=10_000)
    missed = tuple(
        f"{f.kind} {f.target} {f.point or ''}: {f.detail}".strip()
        for f in faults
        if f.result == "missed"
    )
    return World(
        object_keys=tuple(keys),
        open_uploads=len(uploads.get("Uploads", [])),
        mails=mails,
        queue_depths={q: n for q, (n, _) in counts.items()},
        dead_letters=tuple((d.job_id, d.reason) for d in dead),
        faults_missed=missed,
        dead_lettering={q: held for q, (_, held) in counts.items() if held},
    )


async def object_versions(endpoint: str, bucket: str) -> dict[str, int]:
    """How many times result objects were written: rewrites by retries are allowed, and shown."""
    versions: dict[str, int] = {}
    async with get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1"
    ) as client:
        paginator = client.get_paginator("list_object_versions")
        async for page in paginator.paginate(Bucket=bucket):
            for v in page.get("Versions", []):
                versions[v["Key"]] = versions.get(v["Key"], 0) + 1
    rewritten = {k: n for k, n in versions.items() if n > 1}
    return {"objects": len(versions), "rewritten": len(rewritten), "writes": sum(versions.values())}


def report(
    opts: ChaosOptions,
    plan: Plan,
    sandbox: Sandbox,
    records: list[Record],
    faults: list[FaultLog],
    cluster: Cluster,
    verdict: Verdict,
    quiet: float | None,
    elapsed: float,
) -> dict[str, Any]:
    return {
        "seed": opts.seed,
        "jobs": opts.jobs,
        "profile": opts.profile,
        "poison": opts.poison,
        "run_id": sandbox.run_id,
        "database": sandbox.database,
        "elapsed_seconds": round(elapsed, 1),
        "settled_after_seconds": None if quiet is None else round(quiet, 1),
        "replay": f"jobrelay chaos --seed {opts.seed} --jobs {opts.jobs} --profile {opts.profile}"
        + (f" --cluster {opts.cluster_nodes}" if opts.cluster_nodes else "")
        + ("" if opts.limits else " --no-limits"),
        "limits": opts.limits,
        **as_json(verdict),
        "faults": [asdict(f) for f in faults],
        "exits": [asdict(e) for e in cluster.exits],
        "unknown_requests": [
            {"key": r.submission.key, **asdict(q)}
            for r in records
            for q in r.requests
            if q.outcome != "ok"
        ][:200],
    }


def print_table(
    verdict: Verdict, faults: list[FaultLog], cluster: Cluster, quiet: float | None
) -> None:
    table = Table(title="chaos: faults injected", show_edge=False)
    for column in ("at", "fault", "target", "result", "detail"):
        table.add_column(column)
    for f in faults:
        table.add_row(
            f"{f.at:.1f}s", _fault_label(f), f.target,
            f.result, f.detail,
        )  # fmt: skip
    console.print(table)
    exits: dict[str, int] = {}
    for e in cluster.exits:
        exits[e.cause] = exits.get(e.cause, 0) + 1
    console.print(f"process exits by cause: {exits}; settled after: {quiet}")
    checks = Table(title="chaos: checks", show_edge=False)
    checks.add_column("check")
    checks.add_column("value", justify="right")
    checks.add_column("")
    for name, value in verdict.violations.items():
        checks.add_row(name, str(value), "ok" if value == 0 else "[red]VIOLATION[/red]")
    for name, value in verdict.counts.items():
        checks.add_row(name, str(value), "")
    console.print(checks)
    for kind, examples in verdict.examples.items():
        for example in examples:
            console.print(f"  {kind}: {example}")


def _fault_label(fault: FaultLog) -> str:
    if not fault.point:
        return fault.kind
    what = "failover while held at" if fault.kind == "postgres_failover" else "crash at"
    return f"{what} {fault.point}"


def failover_line(verdict: Verdict, faults: list[FaultLog], exits: list[Exit]) -> str | None:
    """With ``--failover``: the failovers, how many recovered (a job succeeded on the new
    primary) and the slowest recovery, and the verdict's counts per 10,000 accepted jobs (a
    short run and a long one read alike); None without failovers."""
    done = [f for f in faults if f.kind == "postgres_failover"]
    if not done:
        return None
    recoveries = [
        float(m.group(1)) for f in done if (m := _RECOVERY.search(f.detail or "")) is not None
    ]
    c, v = verdict.counts, verdict.violations
    scale = 10_000 / max(c["accepted"], 1)

    def per(n: int) -> str:
        return f"{n * scale:g}"

    gave_up = sum(1 for e in exits if e.cause == "unexpected" and e.code >= 0)
    slowest = f"{max(recoveries):.2f}s" if recoveries else "n/a"
    return (
        f"failover: failovers={len(done)} held={sum(f.result == 'fired' for f in done)} "
        f"recovered={len(recoveries)} slowest_recovery={slowest} per_10k_jobs: "
        f"lost={per(v['lost'])} executed_twice={per(v['dup_results'])} "
        f"effects_twice={per(v['dup_emails'])} stuck={per(v['stuck'])} exited={gave_up}"
    )


_RECOVERY = re.compile(r"first job succeeded after (\d+(?:\.\d+)?)s")
