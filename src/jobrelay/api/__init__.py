"""The HTTP API: accept jobs, show their state, events and result. See ``create_app``."""

from jobrelay.api.app import create_app

__all__ = ["create_app"]
