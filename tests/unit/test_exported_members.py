"""The public names, listed literally: a rename or a dropped name fails here first, not in a
user's import (docs/reference/library.md documents these two modules)."""

from __future__ import annotations

import importlib

import pytest

import jobrelay
import jobrelay.http

JOBRELAY = [
    "App",
    "Backoff",
    "ConcurrencyLimit",
    "ConfigError",
    "IdempotencyConflict",
    "InvalidDependencies",
    "InvalidParams",
    "InvalidRunTime",
    "Job",
    "JobContext",
    "JobDefinition",
    "JobFailed",
    "JobNotFound",
    "JobState",
    "JobrelayError",
    "Permanent",
    "RateLimit",
    "Result",
    "ResultWriter",
    "Retry",
    "Schedule",
    "Settings",
    "SyncJobContext",
    "create_engine",
]
JOBRELAY_HTTP = [
    "ACCEPT_RESPONSES",
    "AUTH_RESPONSES",
    "IDEMPOTENCY_CONFLICT",
    "IDEMPOTENCY_KEY_PATTERN",
    "MAX_BODY_BYTES",
    "AcceptDep",
    "Accepted",
    "Acceptor",
    "Admission",
    "Caller",
    "CallerDep",
    "FieldError",
    "IdempotencyKey",
    "ProblemError",
    "TraceParent",
    "ValidationProblem",
    "WireModel",
    "parse_body",
    "problem_openapi",
    "read_body",
    "valid_traceparent",
]


def test_jobrelay_all_is_the_documented_list() -> None:
    assert sorted(jobrelay.__all__) == sorted(JOBRELAY)


def test_jobrelay_http_all_is_the_documented_list() -> None:
    assert sorted(jobrelay.http.__all__) == sorted(JOBRELAY_HTTP)


@pytest.mark.parametrize(
    ("module", "name"),
    [("jobrelay", n) for n in JOBRELAY] + [("jobrelay.http", n) for n in JOBRELAY_HTTP],
)
def test_each_public_name_imports(module: str, name: str) -> None:
    # ``from module import name``: jobrelay's names are loaded on first use (PEP 562).
    assert getattr(importlib.import_module(module), name) is not None
