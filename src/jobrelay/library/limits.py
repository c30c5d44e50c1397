"""Limits per key, as an application declares them: ``@app.job(..., limits=[...])``.

``ConcurrencyLimit(2, key=lambda p: p.account_id)``: at most 2 jobs of the type (the same
key) hold a slot at once, across every worker and process; a job holds its slot from its
admission (when the relay hands it to the broker) until the transaction that ends its run
(success, retry, quarantine, cancel) or the reconciler's takeover of an expired lease.
``RateLimit("30/minute", key=…, burst=…)``: at most that many admissions (so starts) per
period per key, a token bucket of ``burst`` tokens (default one second's worth, at least 1).
No key (or a key function answering None): one limit for the type. ``name=``: several types
sharing one limit (say ``name="smtp"``). The rules are ``domain.limits``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jobrelay.domain.limits import (
    CONCURRENCY,
    FAIR,
    KEY_MAX,
    PRIORITY_MAX,
    PRIORITY_MIN,
    RATE,
    JobLimit,
    LimitError,
    default_burst,
    limit_id,
    parse_rate,
)
from jobrelay.errors import ConfigError

KeyFn = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class ConcurrencyLimit:
    max: int
    key: KeyFn | None = None
    name: str | None = None

    def __init__(self, max: int, *, key: KeyFn | None = None, name: str | None = None) -> None:
        if isinstance(max, bool) or not isinstance(max, int) or max < 1:
            raise ConfigError("ConcurrencyLimit", f"max must be a whole number >= 1, got {max!r}")
        _check_name("ConcurrencyLimit", name)
        object.__setattr__(self, "max", max)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "name", name)


@dataclass(frozen=True)
class RateLimit:
    rate: str
    key: KeyFn | None = None
    burst: int | None = None
    name: str | None = None

    def __init__(
        self,
        rate: str,
        *,
        key: KeyFn | None = None,
        burst: int | None = None,
        name: str | None = None,
    ) -> None:
        try:
            parse_rate(rate)
        except LimitError as exc:
            raise ConfigError("RateLimit", str(exc)) from None
        if burst is not None and (
            isinstance(burst, bool) or not isinstance(burst, int) or burst < 1
        ):
            raise ConfigError("RateLimit", f"burst must be a whole number >= 1, got {burst!r}")
        _check_name("RateLimit", name)
        object.__setattr__(self, "rate", rate)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "burst", burst)
        object.__setattr__(self, "name", name)

    @property
    def per_second(self) -> float:
        count, period = parse_rate(self.rate)
        return count / period

    @property
    def tokens(self) -> float:
        count, period = parse_rate(self.rate)
        return float(self.burst) if self.burst is not None else default_burst(count, period)


Limit = ConcurrencyLimit | RateLimit


def _check_name(where: str, name: str | None) -> None:
    if name is not None and (not isinstance(name, str) or not name or len(name) > 64):
        raise ConfigError(where, f"name must be text of 1 to 64 characters, got {name!r}")


def _key(key: object) -> str | None:
    if key is not None and (not isinstance(key, str) or not key or len(key) > KEY_MAX):
        raise ConfigError(
            "limits", f"a limit's key must be text of 1 to {KEY_MAX} characters, got {key!r}"
        )
    return key


def check_limits(job_type: str, limits: Sequence[Any]) -> tuple[Limit, ...]:
    """``limits=`` as ``@app.job`` takes it: limits only, at most one of each name."""
    seen: set[tuple[str, str]] = set()
    for limit in limits:
        if not isinstance(limit, ConcurrencyLimit | RateLimit):
            raise ConfigError(
                "@app.job", f"limits= takes ConcurrencyLimit and RateLimit, not {limit!r}"
            )
        kind = CONCURRENCY if isinstance(limit, ConcurrencyLimit) else RATE
        named = (kind, limit.name or job_type)
        if named in seen:
            raise ConfigError("@app.job", f"two {kind} limits named {named[1]!r} on {job_type}")
        seen.add(named)
    return tuple(limits)


def job_limits(
    job_type: str,
    limits: Sequence[Limit],
    params: Any,
    fair_by: Callable[[Any], str | None] | None = None,
) -> tuple[JobLimit, ...]:
    """The limits a job with ``params`` is under, its keys asked of the key functions."""
    found: list[JobLimit] = []
    if fair_by is not None:
        fair_key = _key(fair_by(params))
        found.append(JobLimit(job_type, FAIR, key=fair_key))
    for limit in limits:
        key = None if limit.key is None else _key(limit.key(params))
        ident = limit_id(limit.name or job_type, key)
        if isinstance(limit, ConcurrencyLimit):
            found.append(JobLimit(ident, CONCURRENCY, max=limit.max))
        else:
            found.append(JobLimit(ident, RATE, per_second=limit.per_second, burst=limit.tokens))
    return tuple(found)


def check_priority(where: str, priority: object) -> int:
    """A priority as ``@app.job`` and ``enqueue`` take it: a whole number 0..9."""
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_MIN <= priority <= PRIORITY_MAX
    ):
        raise ConfigError(
            where,
            f"priority must be a whole number {PRIORITY_MIN}..{PRIORITY_MAX} (higher runs "
            f"first), got {priority!r}",
        )
    return priority


def job_priority(
    job_type: str, queue: str, prioritized: bool, asked: int | None, declared: int | None
) -> int:
    """A job's priority: ``asked`` at its enqueue, else its type's, else 0. Asking one on a
    queue without priorities is refused: nothing would order it, and a job of that queue
    reaches the broker as it comes."""
    if asked is None:
        return declared or 0
    check_priority("enqueue", asked)
    if not prioritized:
        raise ConfigError(
            "enqueue",
            f"priority= for {job_type}: its queue {queue!r} has no priorities; give a job "
            f"type on that queue @app.job(..., priority=N) to order its jobs",
        )
    return asked


__all__ = [
    "ConcurrencyLimit",
    "Limit",
    "RateLimit",
    "check_limits",
    "check_priority",
    "job_limits",
    "job_priority",
]
