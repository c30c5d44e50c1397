"""Hooks: an application's code run when a job succeeds, is retried or is quarantined.

``@app.on_success``, ``@app.on_retry`` and ``@app.on_failure`` (quarantined: failed for good),
for every job type or only those named (``type=``). A hook is called by the worker that
committed the outcome, AFTER its transaction committed and before the delivery is settled:
never inside the fenced transaction, so a hook cannot make an outcome, and the outcome it
sees is the database's. ``on_success`` at least once: a worker that dies between the commit
and the hook leaves the delivery unsettled, and the redelivery, acked as a duplicate of the
finished job, calls it again. ``on_retry`` and ``on_failure`` are called by the worker that
committed the outcome only: a worker killed first loses that call. A hook that raises (or
runs past ``HOOK_SECONDS``) is logged (``hook_failed``) and changes nothing. An ``async
def`` hook runs on the worker's loop; a plain ``def`` one on a thread, with the run's context.

It is the place for what Celery's ``task_success``/``task_retry``/``task_failure`` signals and
Dramatiq's middleware do: notify, count, clean up; never the job's own work, which belongs in
the job, inside its fence.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobrelay.errors import ConfigError

if TYPE_CHECKING:
    from jobrelay.storage.records import JobRecord

log = logging.getLogger("jobrelay.worker")

HOOK_SECONDS = 30.0  # a hook holds its delivery: past this it is abandoned (and logged)
SUCCEEDED, RETRIED, QUARANTINED = "succeeded", "retried", "quarantined"


@dataclass(frozen=True)
class JobOutcome:
    """What a hook is given: the job as its attempt was claimed (its id, type, params,
    account, attempt), the outcome committed (``succeeded``, ``retried``, ``quarantined``),
    the attempt it ended, and the operators' reason of a retry or quarantine (scrubbed)."""

    job: JobRecord
    outcome: str
    attempt: int
    reason: str | None = None


Hook = Callable[[JobOutcome], Awaitable[None] | None]


class HookRegistry:
    """Mixed into ``App``: the registration decorators and the lookup the worker uses."""

    _hook_lists: dict[str, list[tuple[Hook, frozenset[str] | None]]] | None = None

    def on_success(self, fn: Hook | None = None, *, type: object = None) -> Any:
        """Call ``fn(outcome)`` after a job's success commits (``type=``: only those types);
        ``@app.on_success`` or ``@app.on_success(type=...)``."""
        return self._register(SUCCEEDED, fn, type)

    def on_retry(self, fn: Hook | None = None, *, type: object = None) -> Any:
        """Call ``fn(outcome)`` after a failed attempt's retry is scheduled."""
        return self._register(RETRIED, fn, type)

    def on_failure(self, fn: Hook | None = None, *, type: object = None) -> Any:
        """Call ``fn(outcome)`` after a job is quarantined (failed for good)."""
        return self._register(QUARANTINED, fn, type)

    def _register(self, kind: str, fn: Hook | None, types: object) -> Any:
        only = _type_names(types)

        def add(hook: Hook) -> Hook:
            if not callable(hook):
                raise ConfigError(f"@app.on_{kind}", f"{hook!r} is not callable")
            if self._hook_lists is None:
                self._hook_lists = {SUCCEEDED: [], RETRIED: [], QUARANTINED: []}
            self._hook_lists[kind].append((hook, only))
            return hook

        return add(fn) if fn is not None else add

    def hooks_for(self, kind: str, job_type: str) -> list[Hook]:
        """The hooks to call for ``kind`` on a job of ``job_type``, in registration order."""
        if self._hook_lists is None:
            return []
        return [h for h, only in self._hook_lists[kind] if only is None or job_type in only]


def _type_names(types: object) -> frozenset[str] | None:
    """``type=``: a name, a job definition, or several of them; None: every type."""
    if types is None:
        return None
    items = types if isinstance(types, Iterable) and not isinstance(types, str) else [types]
    names = set()
    for item in items:
        name = item if isinstance(item, str) else getattr(item, "type", None)
        if not isinstance(name, str):
            raise ConfigError("@app.on_…", f"type={item!r} is not a job type or its name")
        names.add(name)
    return frozenset(names)


async def call_hooks(hooks: list[Hook], outcome: JobOutcome) -> None:
    """Each hook in turn; one that raises or runs too long is logged and the next runs."""
    for hook in hooks:
        try:
            if inspect.iscoroutinefunction(hook):
                await asyncio.wait_for(hook(outcome), HOOK_SECONDS)
            else:
                # A thread of the loop's pool (``to_thread`` copies the run's context); one
                # that outlives its 30 s keeps running there, abandoned.
                returned = await asyncio.wait_for(asyncio.to_thread(hook, outcome), HOOK_SECONDS)
                if inspect.isawaitable(returned):  # a callable object with ``async __call__``
                    await asyncio.wait_for(returned, HOOK_SECONDS)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the worker is stopping: not the hook's doing
            _failed(hook, outcome, "cancelled")
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            _failed(hook, outcome, exc)


def _failed(hook: Hook, outcome: JobOutcome, exc: BaseException | str) -> None:
    """A hook that raised (or ran too long): logged, the job unchanged."""
    log.warning(
        "hook %s failed: %s",
        getattr(hook, "__qualname__", repr(hook)),
        exc if str(exc) else type(exc).__name__,
        exc_info=isinstance(exc, BaseException),
        extra={
            "event": "hook_failed",
            "jobId": outcome.job.id,
            "attempt": outcome.attempt,
            "outcome": outcome.outcome,
        },
    )
