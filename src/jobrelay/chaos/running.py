"""How many jobs of one key ran at once, read from their timelines: the soak's check of a
concurrency limit per key (``ConcurrencyLimit``, issue 36).

A job runs from its claim to the event of the transition that ends its run and gives its slot
back (``storage.audit.RUN_ENDS``: success, retry, quarantine, cancel, the reconciler's
takeover of an expired lease). A second claim while it runs is a redelivery taking the
expired lease over: the same run goes on, with the same slot, and is not counted twice. An
end and a start at the same instant are taken end first: a job admitted into a slot that
another's end gave back can only be claimed after that end was written. Pure: the soak
reads the events, this counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from jobrelay.storage.audit import RUN_ENDS, RUN_STARTS, RunEvent


@dataclass
class Peak:
    """The most jobs of one key running at once, and when that was first reached."""

    most: int = 0
    at: datetime | None = None
    jobs: tuple[str, ...] = field(default_factory=tuple)


def runs_of(events: Iterable[RunEvent]) -> dict[str, list[tuple[datetime, datetime | None]]]:
    """Each job's runs as (start, end) from its events in the order they were written; an
    end of None: still running when the timeline was read."""
    runs: dict[str, list[tuple[datetime, datetime | None]]] = {}
    started: dict[str, datetime] = {}
    for event in events:
        if event.kind == RUN_STARTS:
            started.setdefault(event.job_id, event.at)  # a takeover: the same run goes on
        elif event.kind in RUN_ENDS and event.job_id in started:
            runs.setdefault(event.job_id, []).append((started.pop(event.job_id), event.at))
    for job_id, at in started.items():
        runs.setdefault(job_id, []).append((at, None))
    return runs


def running_peaks(
    events: Iterable[RunEvent], key_of: Callable[[str], str | None]
) -> dict[str, Peak]:
    """Per key (``key_of(job_id)``; None: a job not counted), the most jobs running at once."""
    points: list[tuple[datetime, int, str, str]] = []
    for job_id, runs in runs_of(events).items():
        key = key_of(job_id)
        if key is None:
            continue
        for start, end in runs:
            points.append((start, 1, key, job_id))
            if end is not None:
                points.append((end, 0, key, job_id))
    running: dict[str, set[str]] = {}
    peaks: dict[str, Peak] = {}
    for at, starts, key, job_id in sorted(points):  # at one instant, ends (0) first
        now = running.setdefault(key, set())
        if starts:
            now.add(job_id)
        else:
            now.discard(job_id)
        if len(now) > peaks.setdefault(key, Peak()).most:
            peaks[key] = Peak(len(now), at, tuple(sorted(now)))
    return peaks


def overfilled(peaks: dict[str, Peak], limit: int) -> Counter[str]:
    """The keys whose peak passed ``limit``, and by how many jobs."""
    return Counter({key: p.most - limit for key, p in peaks.items() if p.most > limit})


__all__ = ["Peak", "overfilled", "running_peaks", "runs_of"]
