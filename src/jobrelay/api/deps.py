"""Typed access to the one ``Runtime`` an app serves from, kept on ``app.state``.

``app.state`` is an untyped bag; reading it in exactly one place keeps every route typed and
makes a missing runtime a clear error rather than an ``AttributeError`` deep in a handler.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, FastAPI, Request

from jobrelay.api.problems import ProblemError
from jobrelay.runtime.wiring import Runtime

_KEY = "runtime"


def set_runtime(app: FastAPI, runtime: Runtime | None) -> None:
    setattr(app.state, _KEY, runtime)


def get_runtime(app: FastAPI) -> Runtime:
    runtime = getattr(app.state, _KEY, None)
    if not isinstance(runtime, Runtime):
        raise RuntimeError("the API has no runtime: it is not started, or already shut down")
    return runtime


async def runtime_of(request: Request) -> Runtime:
    """The request's runtime; 503 while the app is starting or stopping (no runtime yet).

    Async on purpose: a plain ``def`` dependency would be run in a worker thread.
    """
    runtime = getattr(request.app.state, _KEY, None)
    if not isinstance(runtime, Runtime):
        raise ProblemError(503, "the service is starting or stopping; try again shortly")
    return runtime


RuntimeDep = Annotated[Runtime, Depends(runtime_of)]
