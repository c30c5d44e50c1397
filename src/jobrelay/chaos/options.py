"""What one ``jobrelay chaos`` run is asked to do (the command's options), and its processes.

Its own module so that the report, which prints them, and the run, which writes the report,
do not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jobrelay.chaos.sandbox import Services

WORKERS = ("worker-1", "worker-2")
RELAYS = ("relay-1", "relay-2")


@dataclass
class ChaosOptions:
    jobs: int = 2000
    seed: int = 1
    profile: str = "full"
    poison: int = 3
    concurrency: int = 8
    rate: float | None = None  # submissions per second; None: spread over the fault plan
    settle_timeout: float = 240.0
    crash_timeout: float = 30.0
    out_dir: Path = Path("chaos-results")
    keep: bool = False
    services: Services = field(default_factory=Services)
    cluster_nodes: int = 0  # >0: run on a RabbitMQ cluster of this many nodes, started here
    # The processes run ``chaos.limited_app`` (exports under a concurrency limit per account),
    # or, with ``--no-limits``, the shipped app.
    limits: bool = True
    # >0: run on a PostgreSQL primary and standby started here, every process given both
    # hosts, and fail over this many times (each the failback of the one before) instead of
    # restarting PostgreSQL; ``synchronous_standby``: the standby confirms every commit.
    failovers: int = 0
    synchronous_standby: bool = True

    @property
    def layout(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(apis, relays, workers): the scale-out layout on a cluster, the small one else."""
        if self.cluster_nodes:
            return (
                ("api-1", "api-2"),
                ("relay-1", "relay-2", "relay-3"),
                tuple(f"worker-{i}" for i in range(1, 5)),
            )
        return ("api",), RELAYS, WORKERS
