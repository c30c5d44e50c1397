"""Find the application a process runs: ``--app pkg.module:app`` or ``JOBRELAY_APP``.

Resolved like uvicorn's app strings, with the current directory importable. Without one,
the shipped export app. Any failure is a ``ConfigError`` naming the variable, so the CLI
prints one line and exits 2.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

from jobrelay.errors import ConfigError
from jobrelay.library.app import App

if TYPE_CHECKING:
    from jobrelay.library.operations import Registry
    from jobrelay.settings import Settings

DEFAULT_APP = "jobrelay.exports.shipped:app"


def load_app(spec: str | None) -> App:
    spec = spec or DEFAULT_APP
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError("JOBRELAY_APP", f"expected 'package.module:attribute', got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("JOBRELAY_APP", f"cannot import {module_name!r}: {exc}") from None
    except Exception as exc:  # the module itself failed while importing
        raise ConfigError(
            "JOBRELAY_APP", f"importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    found = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError("JOBRELAY_APP", f"{module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not isinstance(found, App):
        raise ConfigError(
            "JOBRELAY_APP", f"{spec!r} is a {type(found).__name__}, not a jobrelay.App"
        )
    return found


def default_registry(settings: Settings | None = None) -> Registry:
    """The default app's job types (``DEFAULT_APP``), built with ``settings`` (else the app's
    own, from the environment). Here, not in ``library.operations``: the port knows no app, the
    loader knows them all."""
    return load_app(None).registry(settings)
