"""What a job definition refuses, and how it says so: at definition time (a params that is no
pydantic model, a function the worker cannot call as ``fn(ctx, params)``) and at a call (an
unknown type, a connection that is not one jobrelay can write on, a database without the
schema). Each is one sentence naming what to do instead.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import DBAPIError

from jobrelay.errors import ConfigError


def field_errors(exc: ValidationError) -> list[dict[str, str]]:
    return [
        {"field": ".".join(str(p) for p in err["loc"]), "message": err["msg"]}
        for err in exc.errors(include_url=False)
    ]


def unknown_type(name: str, known: Iterable[str]) -> str:
    """``no job type 'x' in this app``, with the closest known names (difflib)."""
    close = difflib.get_close_matches(name, sorted(known), n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"no job type {name!r} in this app{hint}"


def wrong_connection(conn: object, expected: str, opened_by: str, raw: str = "") -> str:
    kind = f"{type(conn).__module__}.{type(conn).__qualname__}"
    return (
        f"pass the SQLAlchemy {expected} of your transaction (`with engine.{opened_by} as conn`,"
        f" the engine from jobrelay.create_engine or sqlalchemy){raw}, not a {kind}"
    )


RAW_KINDS = (
    " or the psycopg 3 or sqlite3 connection your framework holds"
    " (Django: `django.db.connection.connection`)"
)


def check_params_model(name: str, params: object) -> None:
    """Refuse, where the job is defined, a ``params=`` that is not a pydantic model class
    (``dict``, an instance): it would be accepted here and fail at the first enqueue."""
    if isinstance(params, type) and issubclass(params, BaseModel):
        return
    given = params.__name__ if isinstance(params, type) else f"{params!r}"
    raise ConfigError(
        "@app.job",
        f"{name}: params must be a pydantic model class, got {given}: write"
        " `class Params(BaseModel)` with one typed field per parameter, and"
        " `model_config = ConfigDict(extra='allow')` in it to accept any other keys",
    )


def check_job_signature(name: str, fn: object, model: type[BaseModel]) -> None:
    """Refuse, where the job is defined, a function the worker cannot call as
    ``fn(ctx, params)`` (``def f(params)`` from Celery's habits): it would be accepted here
    and fail on every attempt at run time, until the job was quarantined."""
    try:
        signature = inspect.signature(cast("Callable[..., Any]", fn))
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): the run says it
    try:
        signature.bind(None, None)
    except TypeError:
        pass
    else:
        return
    label = getattr(fn, "__name__", None) or "f"
    shown = "f" if not label.isidentifier() else label
    m = model.__name__
    raise ConfigError(
        "@app.job",
        f"{name}: {label}{signature} must take (ctx, params): write"
        f" `async def {shown}(ctx: jobrelay.JobContext[{m}], params: {m})`, or"
        f" `def {shown}(ctx: jobrelay.SyncJobContext[{m}], params: {m})` to run it in a thread",
    )


@contextlib.contextmanager
def schema_missing_hint(where: str) -> Iterator[None]:
    """A database without jobrelay's tables: say to run ``jobrelay db upgrade``."""
    try:
        yield
    except DBAPIError as exc:
        text = (str(exc.orig).splitlines() or [""])[0]
        if "no such table" in text or getattr(exc.orig, "sqlstate", None) == "42P01":
            raise ConfigError(
                where, f"the database has no jobrelay schema ({text}): run `jobrelay db upgrade`"
            ) from exc
        raise


__all__ = [
    "RAW_KINDS",
    "check_job_signature",
    "check_params_model",
    "field_errors",
    "schema_missing_hint",
    "unknown_type",
    "wrong_connection",
]
