"""What the soak does, decided up front from the seed, so a failing run can be replayed.

A plan is the list of submissions (who asks for which export, which are poison) and the
ordered list of faults with the pause before each. Nothing here touches a process; the same
seed and sizes give the same plan, byte for byte (see ``describe``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

ACCOUNTS = ("acme", "globex", "initech")
# Healthy exports use 2019-02 … 2021-12; 2019-01 of initech is reserved for poison jobs, so a
# fault selector can poison exactly them (``export.run:transient@accountId=initech&…``).
POISON_ACCOUNT, POISON_PERIOD = "initech", "2019-01"
HEALTHY_PERIODS = tuple(
    f"{year}-{month:02d}" for year in (2019, 2020, 2021) for month in range(1, 13)
)[1:]

# Where each named fault point lives, so it is armed on a process that will reach it.
FAULT_POINTS: dict[str, str] = {
    "export.run": "worker",
    "worker.before_ack": "worker",
    "notify.after_send": "worker",
    "relay.before_mark": "relay",
    "api.before_response": "api",
}

# Where ``--failover`` fails PostgreSQL over, in turn: a process of the role is held there (a
# ``stall``) while the primary is stopped and the standby promoted. Right after an accept
# commits; between a publish's confirm and its mark; right after a claim commits; between a
# completion's commit and its ack; inside a reconciler pass, after its read.
FAILOVER_POINTS: tuple[tuple[str, str], ...] = (
    ("api.before_response", "api"),
    ("relay.before_mark", "relay"),
    ("claim.after_commit", "worker"),
    ("worker.after_complete", "worker"),
    ("reconcile.pass", "relay"),
)
FAILOVER_STALL_SECONDS = 3

FaultKind = Literal[
    "kill",
    "crash",
    "rabbitmq_restart",
    "postgres_restart",
    "postgres_failover",
    "node_stop",
    "node_start",
]


@dataclass(frozen=True)
class Submission:
    index: int
    account: str
    period: str
    email: str
    key: str  # the Idempotency-Key, stable across the client's retries
    poison: bool


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    target: str  # role name(s, comma-separated) for kill/crash, the service for restarts
    point: str | None = None  # for crash: the fault spec armed on the target
    pause: float = 0.0  # seconds to wait before this fault


@dataclass(frozen=True)
class Profile:
    """How hard to push: sizes of the soak. ``full`` is ``make chaos``, ``short`` runs in CI."""

    name: str
    worker_kills: int
    relay_kills: int
    service_restarts: bool
    pause: tuple[float, float]  # seconds between faults, drawn uniformly
    # On a soak cluster (``--cluster N``), in this order, instead of the broker restart:
    # "leader" stops the node leading the work queue, "stopped" starts the node stopped last,
    # "other" stops a running node that was not stopped before.
    node_faults: tuple[str, ...] = ()


PROFILES = {
    "full": Profile(
        "full", worker_kills=4, relay_kills=3, service_restarts=True, pause=(3, 7),
        node_faults=("leader", "stopped", "other"),
    ),
    "short": Profile(
        "short", worker_kills=1, relay_kills=1, service_restarts=True, pause=(2, 4),
        node_faults=("leader",),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    seed: int
    submissions: tuple[Submission, ...]
    faults: tuple[Fault, ...]

    def describe(self) -> list[str]:
        return [
            f"+{f.pause:.1f}s {f.kind} {f.target}" + (f" at {f.point}" if f.point else "")
            for f in self.faults
        ]


# Roughly how long each fault takes to inject, to spread the submissions over the whole plan.
_TAKES = {
    "kill": 0.2,
    "crash": 4.0,
    "rabbitmq_restart": 12.0,
    "postgres_restart": 6.0,
    "postgres_failover": 5.0,
    "node_stop": 8.0,
    "node_start": 10.0,
}


def fault_steps(plan: Plan) -> list[float]:
    """Each fault's estimated time, its pause included: how the submissions are spread
    (``chaos.clients.Pacer``)."""
    return [f.pause + _TAKES[f.kind] for f in plan.faults]


def make_plan(
    seed: int,
    jobs: int,
    poison: int,
    profile: Profile,
    workers: tuple[str, ...],
    relays: tuple[str, ...],
    api: str = "api",
    *,
    rabbit_nodes: int = 0,
    failovers: int = 0,
) -> Plan:
    """The plan; with ``rabbit_nodes`` (the soak runs its own cluster) the broker restart is
    replaced by the profile's node faults, spread evenly over the plan in their order. With
    ``failovers`` (the soak runs its own primary and standby) the PostgreSQL restart is
    replaced by that many failovers, each the failback of the one before, each while a
    process is held at the next hand-off of ``FAILOVER_POINTS``."""
    if jobs < 1 or not 0 <= poison < jobs:
        raise ValueError("need at least one job, and fewer poison jobs than jobs")
    rng = random.Random(seed)
    poison_at = set(rng.sample(range(jobs), poison))
    submissions = []
    for i in range(jobs):
        bad = i in poison_at
        submissions.append(
            Submission(
                index=i,
                account=POISON_ACCOUNT if bad else rng.choice(ACCOUNTS),
                period=POISON_PERIOD if bad else rng.choice(HEALTHY_PERIODS),
                email=f"client-{i}@example.com",
                key=f"chaos-{seed}-{i}",
                poison=bad,
            )
        )
    crashes: list[Fault] = []
    # A crash point is armed on every process of its role and the first to reach it crashes:
    # RabbitMQ may hand one worker only e-mail jobs and the other only exports for a while.
    by_role = {"worker": ",".join(workers), "relay": ",".join(relays), "api": api}
    for point, role in FAULT_POINTS.items():
        crashes.append(Fault("crash", by_role[role], point=f"{point}:crash:1"))
    others = [Fault("kill", rng.choice(workers)) for _ in range(profile.worker_kills)]
    others += [Fault("kill", rng.choice(relays)) for _ in range(profile.relay_kills)]
    if failovers:
        for i in range(failovers):
            point, role = FAILOVER_POINTS[i % len(FAILOVER_POINTS)]
            spec = f"{point}:stall:{FAILOVER_STALL_SECONDS}:1"
            others.append(Fault("postgres_failover", by_role[role], point=spec))
    elif profile.service_restarts:
        others.append(Fault("postgres_restart", "postgres"))
    if profile.service_restarts and not rabbit_nodes:
        others.append(Fault("rabbitmq_restart", "rabbitmq"))
    rng.shuffle(crashes)
    rng.shuffle(others)
    # A crash point fires only when work reaches it, so the crashes go in the first 60% of
    # the plan, while the load is sure to be there; e-mails exist only after exports finish,
    # so the notify crash never goes first.
    total = len(crashes) + len(others)
    early = max(len(crashes), int(total * 0.6))
    slots = set(rng.sample(range(early), len(crashes)))
    faults = [crashes.pop() if i in slots else others.pop() for i in range(total)]
    if len(faults) > 1 and (faults[0].point or "").startswith("notify"):
        faults[0], faults[1] = faults[1], faults[0]
    # A point only an accept reaches (``api.before_response``: its crash, a failover held
    # there) fires only while submissions last, and they are spread over the plan's
    # estimated time: such faults come right after the first. (CI, on a machine slower than
    # the estimates: a failover held there came at 58 % of the plan, after the last
    # submission, and never fired.)
    accepts = [f for f in faults[1:] if (f.point or "").startswith("api.")]
    faults = [faults[0], *accepts, *(f for f in faults[1:] if f not in accepts)]
    if rabbit_nodes:
        # Ordered (a node must be stopped before it is started), evenly spaced, never first.
        nodes = [
            Fault("node_stop" if t != "stopped" else "node_start", t) for t in profile.node_faults
        ]
        step = len(faults) / (len(nodes) + 1)
        for i, fault in reversed(list(enumerate(nodes))):
            faults.insert(max(1, round(step * (i + 1))), fault)
    timed = tuple(
        Fault(f.kind, f.target, f.point, round(rng.uniform(*profile.pause), 1)) for f in faults
    )
    return Plan(seed, tuple(submissions), timed)
