"""The HTTP API: accept jobs, show their state, events and result. See ``create_app``.

``create_app`` is imported on first use, not with the package: the CLI imports a few names
from ``jobrelay.api`` submodules (patterns, schemas), and every ``jobrelay`` command would
otherwise pay for importing FastAPI and every route at start-up (about a second).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobrelay.api.factory import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from jobrelay.api.factory import create_app

        return create_app
    raise AttributeError(f"module 'jobrelay.api' has no attribute {name!r}")
