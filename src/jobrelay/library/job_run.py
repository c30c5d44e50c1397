"""What is left of a job's run once its function returned, and a follow-up named by its type:
the parts of ``JobDefinition.run`` that need no definition (``library.job_definition``)."""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

from pydantic import BaseModel

from jobrelay.domain.ids import follow_up_job_id, request_hash
from jobrelay.errors import ConfigError, PermanentError
from jobrelay.library.context import JobContext, Result
from jobrelay.library.definition_checks import unknown_type
from jobrelay.library.operations import OperationResult
from jobrelay.observe import tracing
from jobrelay.storage.records import NewJob
from jobrelay.storage.storable import value_json
from jobrelay.storage.store import JobRecord


def named_follow_up(
    job: JobRecord, target: object, params: BaseModel | Mapping[str, Any], types: Set[str]
) -> NewJob:
    """``ctx.follow_up("type", params)``: a job of a type the app includes but does not
    define (its params are checked by the worker that runs it), a child of ``job``."""
    if not isinstance(target, str):
        raise ConfigError("ctx.follow_up", f"{target!r} is not a job definition or a type name")
    if target not in types:
        raise ConfigError("ctx.follow_up", unknown_type(target, types))
    stored = params.model_dump(mode="json") if isinstance(params, BaseModel) else dict(params)
    return NewJob(
        job_id=follow_up_job_id(job.id, target),
        type=target,
        account_id=job.account_id,
        params=stored,
        request_hash=request_hash(job.account_id, target, stored),
        max_attempts=job.max_attempts,
        headers=tracing.follow_up_headers(),
    )


def operation_result(
    returned: Any, context: JobContext[Any], result_max_bytes: int
) -> OperationResult:
    """What the job's function returned, as the worker commits it: a ``Result``, or a plain
    JSON value as ``Result(value=…)``; a value over ``result_max_bytes`` fails the job for
    good (``PermanentError``)."""
    result = returned if isinstance(returned, Result) else Result(value=returned)
    try:
        value = value_json(result.value, result_max_bytes)
    except ValueError as exc:
        raise PermanentError(str(exc)) from None
    return OperationResult(
        result_key=result.key,
        meta=dict(result.meta),
        follow_ups=tuple(context.follow_ups),
        value_json=value,
    )
