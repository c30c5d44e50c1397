"""What ``after=`` asks for, checked before anything is written: the jobs a job runs after
(each once, in the order first named), what one that fails does to it, and how many."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jobrelay.errors import InvalidDependencies

# What a dependency that did not succeed (quarantined, cancelled) does to the waiting job.
AFTER_FAILURE = ("cancel", "run")


@dataclass(frozen=True)
class Dependencies:
    ids: tuple[str, ...] = ()
    after_failure: str = "cancel"

    @property
    def requested(self) -> dict[str, Any] | None:
        """Part of the request's hash (``domain.ids.request_hash``): the same key with other
        dependencies is another request. None without any: the hash jobs had before."""
        if not self.ids:
            return None
        return {"after": list(self.ids), "afterFailure": self.after_failure}


def dependencies_of(after: Iterable[str], after_failure: str, maximum: int) -> Dependencies:
    """``after`` and ``after_failure`` as a job is written with them, or
    ``InvalidDependencies`` saying what is wrong."""
    if isinstance(after, str | bytes):
        raise InvalidDependencies("after= takes a list of job ids, not a single string")
    ids = tuple(dict.fromkeys(after))
    bad = [i for i in ids if not isinstance(i, str) or not i]
    if bad:
        raise InvalidDependencies(f"after= takes job ids (strings), got {bad[0]!r}")
    if after_failure not in AFTER_FAILURE:
        raise InvalidDependencies(
            f"after_failure must be one of {', '.join(AFTER_FAILURE)}, not {after_failure!r}"
        )
    if len(ids) > maximum:
        raise InvalidDependencies(
            f"after= names {len(ids)} jobs; a job may run after at most {maximum}"
            " (JOBRELAY_MAX_DEPENDENCIES)"
        )
    return Dependencies(ids, after_failure)


__all__ = ["AFTER_FAILURE", "Dependencies", "dependencies_of"]
