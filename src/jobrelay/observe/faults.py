"""Named fault points for fault tests: ``JOBRELAY_FAULTS="point:action[:n][@k=v[&k=v]],…"``.

``stall`` takes its duration too: ``point:stall:SECONDS[:n][@k=v…]``.

Off by default. When any fault is armed, the process says so loudly at start-up, because a
production process with faults armed is a misconfiguration worth noticing.

Points and actions:
- ``export.run:transient|invalid|crash[:n]`` — n means only on attempt n; without n, every attempt.
- ``export.run:stall:SECONDS[:n]`` — keeps the operation busy for SECONDS (positive, may be
  fractional: ``2.5``) before it goes on normally; n is the attempt, as above. The stall is an
  ``await asyncio.sleep``, so it is cancellable, and the lease heartbeat keeps running during
  it (it is a separate task): this is slow work, not a dead worker. Only ``Faults.ahit``
  stalls; the synchronous ``Faults.hit`` ignores stall faults.
- ``notify.after_send:crash[:n]`` — after the SMTP server accepted a notification, before the
  effects ledger says ``sent``; n is the notify job's attempt, as for ``export.run``.
- ``claim.after_commit:drop[:n]`` — a worker's claim statement committed, then its answer
  is lost: the worker sees ``StoreError`` as if the connection had dropped (it then retries,
  finds its own claim and runs it). n means the n-th claim this process makes; without n,
  every claim (which then never gets past the recovery of its own claim: for tests only).
- ``worker.after_complete:crash[:n]`` — a completion statement committed (a batch of them on
  PostgreSQL, before any of its waiters is answered; a single completion otherwise), no ack
  sent yet; n is the n-th time this process reaches the point, as below.
- ``worker.before_ack:crash[:n]``, ``relay.before_mark:crash[:n]``,
  ``api.before_response:crash[:n]`` — n means the n-th time this process reaches the point;
  without n, every time.
- ``worker.after_complete:cut[:n]`` — the completion committed, then the server cuts every
  session of the database (``pg_terminate_backend``) before the worker reads the answer: its
  outcome is unknown to it, and it must be resolved by reading, never by running again.
- ``start.after_schema:cut[:n]`` — a process starting found its database and its schema,
  then the server cuts every session (a failover mid-start): the process checks again
  until the database answers, it does not exit. Give n (``:1``): without it, every check
  is cut again until the start-up's outage allowance runs out.
- ``stall`` at a hand-off (``api.before_response``, ``relay.before_mark``,
  ``claim.after_commit``, ``worker.after_complete``, ``worker.before_ack``) or in a reconciler
  pass (``reconcile.pass``, after it read the clock, before its first repair) holds the
  process there for SECONDS: ``jobrelay chaos --failover`` fails PostgreSQL over meanwhile.

``@k=v`` narrows a fault to jobs whose parameters match (``export.run:invalid@period=2019-12``),
so the demo and the soak can poison chosen jobs while the rest flow. It works with ``stall``
too: ``export.run:stall:20:1@period=2020-05`` slows only first attempts of that period's jobs.

``crash`` ends the process at once with ``os._exit``, like ``kill -9``: no finally blocks, no
acks, no flushes. Tests of a single process can swap ``crash_handler`` to raise instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NoReturn

from jobrelay.errors import ConfigError, PermanentError, StoreError, TransientError

log = logging.getLogger("jobrelay.faults")

POINTS: dict[str, frozenset[str]] = {
    "export.run": frozenset({"transient", "invalid", "crash", "stall"}),
    "worker.before_ack": frozenset({"crash", "stall"}),
    "worker.after_complete": frozenset({"crash", "stall", "cut"}),
    "relay.before_mark": frozenset({"crash", "stall"}),
    "api.before_response": frozenset({"crash", "stall"}),
    "notify.after_send": frozenset({"crash"}),
    "claim.after_commit": frozenset({"drop", "stall"}),
    # A reconciler pass that has read the database's clock, before its first repair.
    "reconcile.pass": frozenset({"stall"}),
    # A process starting has found its database and schema, not yet its tables or queue.
    "start.after_schema": frozenset({"cut"}),
}
# Points that know the job's parameters, where an ``@k=v`` selector can apply.
_SELECTABLE_POINTS = frozenset({"export.run", "api.before_response", "notify.after_send"})
# Points whose n counts the job's attempt rather than occurrences in this process.
_ATTEMPT_POINTS = frozenset({"export.run", "notify.after_send"})
CRASH_EXIT_CODE = 137


@dataclass(frozen=True)
class Fault:
    point: str
    action: str
    n: int | None
    match: tuple[tuple[str, str], ...] = ()
    seconds: float | None = None  # only for ``stall``: how long to keep the operation busy

    def applies_to(self, params: Mapping[str, object] | None) -> bool:
        if not self.match:
            return True
        return params is not None and all(str(params.get(k)) == v for k, v in self.match)


def parse(spec: str) -> tuple[Fault, ...]:
    faults: list[Fault] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        item, _, selector = item.partition("@")
        match = _parse_selector(selector, item) if selector else ()
        pieces = item.split(":")
        if len(pieces) < 2:
            raise ConfigError("JOBRELAY_FAULTS", f"expected point:action[:n], got {item!r}")
        point, action = pieces[0], pieces[1]
        if point not in POINTS:
            raise ConfigError("JOBRELAY_FAULTS", f"unknown fault point {point!r}")
        if action not in POINTS[point]:
            raise ConfigError("JOBRELAY_FAULTS", f"{point} does not support action {action!r}")
        if match and point not in _SELECTABLE_POINTS:
            raise ConfigError(
                "JOBRELAY_FAULTS", f"@selectors work only on {sorted(_SELECTABLE_POINTS)}: {item!r}"
            )
        seconds: float | None = None
        rest = pieces[2:]
        if action == "stall":
            if not rest:
                raise ConfigError(
                    "JOBRELAY_FAULTS",
                    f"stall needs its duration, point:stall:SECONDS[:n], in {item!r}",
                )
            if len(rest) > 2:
                raise ConfigError(
                    "JOBRELAY_FAULTS",
                    f"too many fields, expected point:stall:SECONDS[:n], in {item!r}",
                )
            seconds = _parse_seconds(rest[0], item)
            rest = rest[1:]
        elif len(rest) > 1:
            raise ConfigError(
                "JOBRELAY_FAULTS",
                f"too many fields, expected point:action[:n] (only stall takes SECONDS): {item!r}",
            )
        n: int | None = None
        if rest:
            # isascii: str.isdigit() also holds for "²", which int() refuses.
            if not (rest[0].isascii() and rest[0].isdigit()) or int(rest[0]) < 1:
                raise ConfigError("JOBRELAY_FAULTS", f"n must be a positive integer in {item!r}")
            n = int(rest[0])
        faults.append(Fault(point, action, n, match, seconds))
    return tuple(faults)


def _parse_seconds(text: str, item: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(
            "JOBRELAY_FAULTS", f"stall SECONDS must be a positive number, got {text!r} in {item!r}"
        )
    return seconds


def _parse_selector(selector: str, item: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for pair in selector.split("&"):
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ConfigError("JOBRELAY_FAULTS", f"expected @key=value in {item!r}")
        pairs.append((key, value))
    return tuple(pairs)


def _exit_now(point: str) -> NoReturn:
    sys.stderr.write(f"jobrelay: FAULT {point}:crash — exiting now (os._exit)\n")
    sys.stderr.flush()
    os._exit(CRASH_EXIT_CODE)


class Faults:
    """The armed faults of one process, with per-point occurrence counters."""

    def __init__(self, spec: str = "", crash_handler: Callable[[str], NoReturn] = _exit_now):
        self.faults = parse(spec)
        self.crash_handler = crash_handler
        self._seen: Counter[str] = Counter()
        if self.faults:
            log.warning(
                "FAULT INJECTION ARMED: %s — this process will fail on purpose",
                spec,
                extra={"event": "faults_armed", "faults": spec},
            )

    def __bool__(self) -> bool:
        return bool(self.faults)

    def hit(
        self,
        point: str,
        *,
        attempt: int | None = None,
        params: Mapping[str, object] | None = None,
    ) -> None:
        """Call at a named point; does nothing unless a fault is armed there.

        Stall faults are ignored here: only a caller that can await (``ahit``) can stall.
        """
        for fault, count in self._firing(point, attempt, params):
            if fault.action != "stall":
                self._fire(fault, count)

    async def ahit(
        self,
        point: str,
        *,
        attempt: int | None = None,
        params: Mapping[str, object] | None = None,
    ) -> None:
        """``hit`` for async callers: also honours stall faults, with a cancellable sleep."""
        for fault, count in self._firing(point, attempt, params):
            if fault.action != "stall":
                self._fire(fault, count)
                continue
            assert fault.seconds is not None  # parse() guarantees it for stall
            log.warning(
                "fault %s:stall fired (n=%s): stalling for %s s",
                point,
                count,
                fault.seconds,
                extra={"event": "fault_fired", "point": point},
            )
            await asyncio.sleep(fault.seconds)

    def _firing(
        self, point: str, attempt: int | None, params: Mapping[str, object] | None
    ) -> list[tuple[Fault, int | None]]:
        """Count this hit of ``point`` and return the armed faults that apply to it, in order."""
        if not self.faults:
            return []
        self._seen[point] += 1
        count = attempt if point in _ATTEMPT_POINTS else self._seen[point]
        return [
            (fault, count)
            for fault in self.faults
            if fault.point == point
            and (fault.n is None or fault.n == count)
            and fault.applies_to(params)
        ]

    def _fire(self, fault: Fault, count: int | None) -> None:
        point = fault.point
        log.warning(
            "fault %s:%s fired (n=%s)",
            point,
            fault.action,
            count,
            extra={"event": "fault_fired", "point": point},
        )
        if fault.action == "crash":
            self.crash_handler(point)
        if fault.action == "transient":
            raise TransientError(f"injected transient failure at {point} (attempt {count})")
        if fault.action == "invalid":
            raise PermanentError(f"injected invalid payload at {point} (attempt {count})")
        if fault.action == "drop":
            raise StoreError(f"database write failed: injected connection drop at {point}")
        if fault.action == "cut":
            raise ConnectionCut(f"injected connection cut at {point}")


class ConnectionCut(Exception):
    """A ``cut`` fault fired: the caller has the database cut its sessions (it can reach the
    store; this module cannot), then goes on as after a lost connection."""


NO_FAULTS = Faults()
