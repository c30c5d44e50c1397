"""Every dependency of every API route is a coroutine function.

FastAPI runs a plain ``def`` dependency in its thread pool: a thread hop, and the GIL handed
back and forth, on every request that uses it. ``POST /v1/exports`` paid that for its
acceptor (a py-spy profile of the accept bench showed the pool's threads woken per request).
A dependency that does no blocking I/O is ``async def``; one that does is a bug anyway.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

from jobrelay.api.factory import create_app
from jobrelay.settings import Settings


def _routes(routes: Sequence[BaseRoute]) -> Iterator[APIRoute]:
    """Every API route, through the routers included (FastAPI keeps them nested)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _routes(included.routes)


def _dependencies(dependant: Dependant) -> Iterator[Dependant]:
    for sub in dependant.dependencies:
        yield sub
        yield from _dependencies(sub)


def test_no_route_runs_a_dependency_in_the_thread_pool() -> None:
    app = create_app(Settings(database_url="sqlite:///unused.db"))
    routes = list(_routes(app.routes))
    assert any(r.path == "/v1/exports" for r in routes)  # the flagship route is looked at
    sync = sorted(
        {
            f"{route.path}: {dep.call.__qualname__}"
            for route in routes
            for dep in _dependencies(route.dependant)
            if dep.call is not None
            and not inspect.iscoroutinefunction(dep.call)
            and not inspect.iscoroutinefunction(type(dep.call).__call__)
        }
    )
    assert sync == []
