"""Limits per key, as rules: which waiting jobs may be handed to the broker now.

A job of a limited type carries its limits, each named by a ``limit_id`` (the limit's name and
the job's key): a concurrency limit (at most ``max`` jobs of that id holding a slot: admitted
and not yet finished) and a rate limit (a token bucket of ``burst`` tokens refilled at
``per_second``; one token per admission). The relay asks ``admit`` which of the waiting jobs
to hand to the broker, given how many slots each id holds and how many tokens each bucket has;
a job is admitted only when every one of its limits has room, and the jobs of different keys
are taken in turn (oldest first within a key), so one key's backlog delays another key's job
by at most one round. No I/O here: the store reads the state and writes the answer.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

CONCURRENCY = "concurrency"
RATE = "rate"
# Fair between keys (``@app.job(fair_by=…)``): no limit per key, but the type's jobs are
# admitted at most ``fair_ahead`` ahead of their end, so that the turns across keys decide
# the order in which they reach the broker (a FIFO queue would keep the order they came in).
FAIR = "fair"
# Priority inside a queue (``@app.job(priority=…)``): every job of a prioritized queue waits
# for its admission, which takes the highest priority first; at most ``priority_ahead`` of the
# queue's jobs are admitted and not yet ended, so a backlog in the broker's FIFO queue never
# holds more than that many ahead of a job of higher priority.
PRIORITY = "priority"
PRIORITY_MIN, PRIORITY_MAX = 0, 9
_PERIODS = {"second": 1.0, "minute": 60.0, "hour": 3600.0}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(second|minute|hour)\s*$")
# The separator of a limit id's name and key: never in a name (a job type's or a limit's).
_SEP = "\x1f"
KEY_MAX = 200


class LimitError(ValueError):
    """A limit that cannot be: a bad rate, a max below 1, a key that is not text."""


def parse_rate(rate: str) -> tuple[int, float]:
    """``"N/second|minute|hour"`` as (N, the period in seconds)."""
    match = _RATE.match(rate) if isinstance(rate, str) else None
    if match is None or int(match.group(1)) < 1:
        raise LimitError(f"rate {rate!r} must be 'N/second', 'N/minute' or 'N/hour' with N >= 1")
    return int(match.group(1)), _PERIODS[match.group(2)]


def default_burst(count: int, period: float) -> float:
    """One second's worth of the rate, and at least one token."""
    return max(1.0, float(math.floor(count / period)))


def limit_id(name: str, key: str | None) -> str:
    """The identity of one key's limit: its name, and the key (none: the type's one limit)."""
    return name if key is None else f"{name}{_SEP}{key}"


def split_id(limit: str) -> tuple[str, str | None]:
    name, sep, key = limit.partition(_SEP)
    return name, (key if sep else None)


@dataclass(frozen=True)
class JobLimit:
    """One limit a job is under, as stored with the job."""

    limit_id: str
    kind: str
    max: int | None = None  # concurrency
    per_second: float | None = None  # rate
    burst: float | None = None  # rate
    key: str | None = None  # fair: the job's key, whose turn it takes

    def to_json(self) -> dict[str, object]:
        if self.kind == CONCURRENCY:
            return {"id": self.limit_id, "kind": self.kind, "max": self.max}
        if self.kind == FAIR:
            return {"id": self.limit_id, "kind": self.kind, "key": self.key}
        if self.kind == PRIORITY:
            return {"id": self.limit_id, "kind": self.kind}
        return {
            "id": self.limit_id,
            "kind": self.kind,
            "perSecond": self.per_second,
            "burst": self.burst,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> JobLimit:
        kind = str(data["kind"])
        if kind == PRIORITY:
            return cls(str(data["id"]), kind)
        if kind == FAIR:
            key = data.get("key")
            return cls(str(data["id"]), kind, key=None if key is None else str(key))
        if kind == CONCURRENCY:
            return cls(str(data["id"]), kind, max=int(data["max"]))  # type: ignore[call-overload]
        return cls(
            str(data["id"]),
            kind,
            per_second=float(data["perSecond"]),  # type: ignore[arg-type]
            burst=float(data["burst"]),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class Candidate:
    """A job waiting to be handed to the broker, oldest first by ``order``."""

    job_id: str
    limits: tuple[JobLimit, ...]
    order: int
    fair_key: str | None = None
    priority: int = 0  # in its queue, higher first: taken before any lower one


@dataclass
class Bucket:
    """A rate limit's tokens at ``at`` (seconds on the store's clock)."""

    tokens: float
    at: float

    def refilled(self, now: float, per_second: float, burst: float) -> float:
        return min(burst, self.tokens + max(0.0, now - self.at) * per_second)


@dataclass(frozen=True)
class Override:
    """An operator's runtime value for a limit id (or a whole limit name), replacing the
    one the code declared: a concurrency ``max`` or a rate."""

    max: int | None = None
    per_second: float | None = None
    burst: float | None = None


@dataclass
class Admission:
    admitted: list[str] = field(default_factory=list)
    # Why each job left waiting waits: the first limit that had no room for it.
    held: dict[str, JobLimit] = field(default_factory=dict)
    # Each bucket's tokens after the admissions (written back with ``now``).
    buckets: dict[str, float] = field(default_factory=dict)
    # The slots each concurrency limit id holds after the admissions.
    slots: dict[str, int] = field(default_factory=dict)


def effective(limit: JobLimit, overrides: Mapping[str, Override]) -> JobLimit:
    """The limit as it holds now: an override of its id, else of its name, else as declared."""
    name, _ = split_id(limit.limit_id)
    found = overrides.get(limit.limit_id) or overrides.get(name)
    if found is None:
        return limit
    if limit.kind == CONCURRENCY and found.max is not None:
        return JobLimit(limit.limit_id, limit.kind, max=found.max)
    if limit.kind == RATE and found.per_second is not None:
        burst = found.burst if found.burst is not None else max(1.0, math.floor(found.per_second))
        return JobLimit(limit.limit_id, limit.kind, per_second=found.per_second, burst=burst)
    return limit


def limiting(limits: Sequence[JobLimit]) -> bool:
    """Whether the job is under a limit (a slot or a token), not only fair by key: a job
    only fair by key (``fair_by=``) that no admission held back has the timeline and the
    explanation it would have without fairness."""
    return any(limit.kind not in _ORDERING for limit in limits)


# Kinds that only order the admission (a slot each, capped by a setting, not a limit per key).
_ORDERING = frozenset({FAIR, PRIORITY})


# A prioritized queue's limit id: no job type's or limit's name has a colon.
PRIORITY_PREFIX = "queue:"


def priority_limit(queue: str) -> JobLimit:
    """The limit every job of prioritized queue ``queue`` is under: its admission's order."""
    return JobLimit(f"{PRIORITY_PREFIX}{queue}", PRIORITY)


def turn_key(limits: Sequence[JobLimit]) -> str | None:
    """Whose turn a job under ``limits`` takes: its fairness key, else its first limit's id
    (a prioritized queue's limit comes last: ``library.limits``). Priority orders the jobs
    of one turn key only: a queue's with no other limit, or each key's; never across keys."""
    for limit in limits:
        if limit.kind == FAIR:
            return f"{limit.limit_id}{_SEP}{limit.key}"
    return limits[0].limit_id if limits else None


def _turn_key(candidate: Candidate) -> str | None:
    if candidate.fair_key is not None:
        return candidate.fair_key
    return turn_key(candidate.limits)


def in_turns(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The candidates in turns across keys (``_turn_key``), keys in the order of their first
    job; within a key the highest priority first (a prioritized queue's jobs share its
    key, ``turn_key``), then the oldest."""
    grouped: dict[str | None, list[Candidate]] = defaultdict(list)
    for candidate in sorted(candidates, key=lambda c: c.order):
        grouped[_turn_key(candidate)].append(candidate)
    queues = {
        key: deque(sorted(group, key=lambda c: (-c.priority, c.order)))
        for key, group in grouped.items()
    }
    ordered: list[Candidate] = []
    while queues:
        for key in list(queues):
            ordered.append(queues[key].popleft())
            if not queues[key]:
                del queues[key]
    return ordered


def admit(
    candidates: Sequence[Candidate],
    held: Mapping[str, int],
    buckets: Mapping[str, Bucket],
    now: float,
    overrides: Mapping[str, Override] | None = None,
    room: int | None = None,
    fair_ahead: int | None = None,
    priority_ahead: int | None = None,
) -> Admission:
    """Which candidates to admit now, taken in turns across keys, the highest priority first
    within one (``in_turns``), each only when every one of its limits has room: a concurrency limit
    below its max (``held``: the slots each id holds now), a rate limit with a whole token, a
    fair type or a prioritized queue with fewer than ``fair_ahead`` / ``priority_ahead``
    admitted and not ended. At most ``room`` jobs."""
    overrides = overrides or {}
    slots = dict(held)
    tokens: dict[str, float] = {}
    answer = Admission()
    for candidate in in_turns(candidates):
        if room is not None and len(answer.admitted) >= room:
            break
        limits = [effective(limit, overrides) for limit in candidate.limits]
        blocking = None
        for limit in limits:
            if limit.kind in _ORDERING:
                ahead = fair_ahead if limit.kind == FAIR else priority_ahead
                if ahead is not None and slots.get(limit.limit_id, 0) >= ahead:
                    blocking = limit
                    break
            elif limit.kind == CONCURRENCY:
                assert limit.max is not None
                if slots.get(limit.limit_id, 0) >= limit.max:
                    blocking = limit
                    break
            else:
                assert limit.per_second is not None and limit.burst is not None
                if limit.limit_id not in tokens:
                    bucket = buckets.get(limit.limit_id)
                    tokens[limit.limit_id] = (
                        limit.burst
                        if bucket is None
                        else bucket.refilled(now, limit.per_second, limit.burst)
                    )
                if tokens[limit.limit_id] < 1.0:
                    blocking = limit
                    break
        if blocking is not None:
            answer.held[candidate.job_id] = blocking
            continue
        for limit in limits:
            if limit.kind in (CONCURRENCY, *_ORDERING):
                slots[limit.limit_id] = slots.get(limit.limit_id, 0) + 1
            else:
                tokens[limit.limit_id] -= 1.0
        answer.admitted.append(candidate.job_id)
    answer.buckets = tokens
    answer.slots = slots
    return answer


__all__ = [
    "CONCURRENCY",
    "FAIR",
    "KEY_MAX",
    "PRIORITY",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "PRIORITY_PREFIX",
    "RATE",
    "Admission",
    "Bucket",
    "Candidate",
    "JobLimit",
    "LimitError",
    "Override",
    "admit",
    "default_burst",
    "effective",
    "in_turns",
    "limit_id",
    "limiting",
    "parse_rate",
    "priority_limit",
    "split_id",
    "turn_key",
]
