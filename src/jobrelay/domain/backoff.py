"""A job type's retry back-off: exponential, capped, with jitter.

A fixed list of delays makes a thousand jobs that failed together (a dependency's outage)
retry together, and fail together again. ``Backoff`` grows the delay per attempt and spreads
it by a random fraction. The random draw is the caller's (the worker's), so the delay for a
given attempt and draw is a pure function: ``domain.policy.decide`` stays a plain table and
every row of it stays a unit test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jobrelay.errors import ConfigError

# A retry waits at least this long: a zero or negative delay would retry in a hot loop.
SHORTEST_SECONDS = 0.1
LONGEST_SECONDS = 7 * 24 * 3600.0  # a delay this long is a schedule, not a back-off


@dataclass(frozen=True)
class Backoff:
    """``base * factor ** (attempt - 1)`` seconds, at most ``max``, then spread by up to
    ``jitter`` of itself either way (0.2: between 80% and 120%).

    ``Backoff(base=5, factor=2, max=3600, jitter=0.2)``: after the first failure about 5 s,
    then about 10 s, 20 s, ... and never more than 3600 s * 1.2. A retry that waits one of
    these delays is held in the database until due and then published to its work queue
    (no delay queue can hold an arbitrary delay), on both transports.
    """

    base: float = 5.0
    factor: float = 2.0
    max: float = 3600.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        where = "Backoff"
        for name in ("base", "factor", "max", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(where, f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ConfigError(where, f"{name} must be finite, got {value!r}")
        if not SHORTEST_SECONDS <= self.base <= LONGEST_SECONDS:
            raise ConfigError(
                where, f"base must be {SHORTEST_SECONDS}..{LONGEST_SECONDS:.0f} s, got {self.base}"
            )
        if not 1 <= self.factor <= 100:
            raise ConfigError(where, f"factor must be 1..100, got {self.factor}")
        if not self.base <= self.max <= LONGEST_SECONDS:
            raise ConfigError(where, f"max must be base..{LONGEST_SECONDS:.0f} s, got {self.max}")
        if not 0 <= self.jitter < 1:
            raise ConfigError(where, f"jitter must be 0 <= jitter < 1, got {self.jitter}")

    def delay(self, attempt: int, draw: float) -> float:
        """Seconds to wait after attempt ``attempt`` (1-based) failed; ``draw`` is uniform in
        [-1, 1] (the worker's random draw; 0 gives the delay without jitter)."""
        if not -1 <= draw <= 1:
            raise ValueError(f"draw must be in [-1, 1], got {draw}")
        steps = max(0, attempt - 1)
        # Compared as logarithms: factor ** steps overflows a float long before attempt 100.
        if steps * math.log(self.factor) >= math.log(self.max / self.base):
            capped = self.max
        else:
            capped = self.base * self.factor**steps
        return max(SHORTEST_SECONDS, capped * (1 + self.jitter * draw))
