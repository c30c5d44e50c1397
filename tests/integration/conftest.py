"""Fixtures shared by the operations tests (defined in ops_fixtures.py): ``backend`` runs a
test on SQLite + local transport and on PostgreSQL + RabbitMQ; ``make_pipeline`` builds the
in-process pipeline on it. A test module that defines its own fixture of the same name wins."""

from .ops_fixtures import backend, make_pipeline
from .trace_fixtures import json_lines, spans

__all__ = ["backend", "json_lines", "make_pipeline", "spans"]
