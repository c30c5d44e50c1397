"""schemathesis against the API's own OpenAPI document, in process (ASGI, no socket).

Every operation gets generated requests, valid ones (positive) and ones the document says
are invalid (negative), once with an account token and once with an admin token, on the
embedded default (SQLite + the local transport) with the shipped app's sample ledgers. A
response must never be a 5xx, and its status, Content-Type, headers and body must be the
ones the document declares for that operation: the document is the contract clients are
generated from, so a finding is fixed in the server or in the schema, never by leaving a
check or an operation out.

The seed is fixed (``derandomize``), so a failure reproduces on every machine; the number
of examples per operation keeps the whole module within a couple of minutes.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import checks as st_checks
from schemathesis.generation.modes import GenerationMode
from schemathesis.schemas import BaseSchema

from jobrelay.api import create_app
from jobrelay.api.auth import hash_token, new_token
from jobrelay.exports.seed import seed
from jobrelay.settings import Settings
from jobrelay.storage.engine import create_engine, upgrade_async
from jobrelay.storage.store import Store

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 40
CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_headers_conformance,
    st_checks.response_schema_conformance,
]
FUZZ = settings(
    max_examples=EXAMPLES_PER_OPERATION,
    derandomize=True,
    deadline=None,
    database=None,
    # Generated bodies and paths are large and filtered by design; that is not a test bug.
    suppress_health_check=list(HealthCheck),
)
Fuzzed = tuple[Settings, dict[str, str]]

# Times at the calendar's edges: a value the document allows whose UTC instant, once its
# offset is applied, falls outside years 1-9999 (``9999-12-31T23:59:59-23:59``) was an
# OverflowError and a 500. Drawn beside ordinary times for every ``format: date-time``.
_OFFSETS = st.builds(
    timezone,
    st.timedeltas(
        min_value=timedelta(hours=-23, minutes=-59), max_value=timedelta(hours=23, minutes=59)
    ),
)
_EDGES = st.sampled_from(
    [
        "9999-12-31T23:59:59-23:59",
        "9999-12-31T23:59:59.999999-00:01",
        "0001-01-01T00:00:00+23:59",
        "0001-01-01T00:00:00.000001+00:01",
        "9999-12-31T23:59:59Z",
        "0001-01-01T00:00:00Z",
    ]
)
_TIMES = st.datetimes(
    min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59), timezones=_OFFSETS
).map(datetime.isoformat)
schemathesis.openapi.format("date-time", st.one_of(_EDGES, _TIMES))


async def _prepare(database_url: str) -> dict[str, str]:
    await upgrade_async(database_url)
    engine = create_engine(database_url)
    try:
        await seed(engine, 2)
        store = Store(engine)
        now = await store.db_now()
        tokens = {"account": new_token(), "admin": new_token()}
        await store.add_token(hash_token(tokens["account"]), "acme", False, now, "fuzz")
        await store.add_token(hash_token(tokens["admin"]), None, True, now, "fuzz-admin")
        return tokens
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Fuzzed:
    root: Path = tmp_path_factory.mktemp("fuzz")
    settings = Settings(
        database_url=f"sqlite:///{root}/fuzz.db",
        results_url=f"file://{root}/exports",
        # Every operation's answers, not the limiter's: one app takes all the generated
        # requests of one token (the limits have their own tests: test_rate_limit.py).
        rate_limit="off",
    )
    return settings, asyncio.run(_prepare(settings.database_url))


@pytest.fixture(scope="module")
def api_schema(fuzzed: Fuzzed) -> BaseSchema:
    # The app opens its own runtime in its lifespan, on schemathesis's event loop.
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(fuzzed[0]))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("role", ["account", "admin"])
@pytest.mark.long
def test_every_operation_answers_as_documented(
    api_schema: BaseSchema, fuzzed: Fuzzed, role: str, mode: GenerationMode
) -> None:
    headers = {"Authorization": f"Bearer {fuzzed[1][role]}"}
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    for operation in operations:

        @FUZZ
        @given(case=operation.as_strategy(mode))
        def call(case: schemathesis.Case) -> None:
            statuses[case.call_and_validate(headers=headers, checks=CHECKS).status_code] += 1

        try:
            call()
        except Unsatisfiable:
            # An operation with no inputs (GET /healthz) has no invalid request to make.
            assert mode is GenerationMode.NEGATIVE and not operation.path_parameters
        except Exception as exc:  # one operation's finding must not hide the next one's
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
    assert statuses[422] > 0, statuses
    if mode is GenerationMode.POSITIVE:
        # The token was never refused, so the requests reached the handlers behind it
        # (negative cases also send malformed Authorization headers, rightly 401).
        assert statuses[401] == 0 and statuses[200] > 0, statuses
        assert statuses[202] > 0 or role == "account", statuses  # jobs for any account


def _nested(depth: int, kind: str) -> bytes:
    if kind == "array":
        return b"[" * depth + b"]" * depth
    if kind == "object":
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b'{"params": ' + b"[" * depth  # unterminated, as an attacker may send it


@pytest.mark.timeout(600)
@pytest.mark.parametrize("role", ["account", "admin"])
def test_every_body_nested_too_deep_is_a_problem_not_a_500(
    api_schema: BaseSchema, fuzzed: Fuzzed, role: str
) -> None:
    """Every operation the document gives a JSON body (found there, so a new route is
    covered without a list to keep), sent bodies nested 100 to 20,000 deep: a 4xx
    problem+json, never a 5xx (a RecursionError was a 500 on every JSON route)."""
    headers = {"Authorization": f"Bearer {fuzzed[1][role]}", "Content-Type": "application/json"}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    with_body = [op for op in operations if op.body]
    assert len(with_body) >= 5, [op.label for op in with_body]
    seen: Counter[int] = Counter()
    for operation in with_body:

        @FUZZ
        @given(
            case=operation.as_strategy(GenerationMode.POSITIVE),
            depth=st.integers(min_value=100, max_value=20_000),
            kind=st.sampled_from(["array", "object", "unterminated"]),
        )
        def call(case: schemathesis.Case, depth: int, kind: str) -> None:
            response = case.call(headers=headers, data=_nested(depth, kind), json=None)
            assert 400 <= response.status_code < 500, (case.operation.label, response.status_code)
            assert "application/problem+json" in str(response.headers.get("content-type"))
            json.loads(response.content)
            seen[response.status_code] += 1

        call()
    assert seen[422] > 0, seen
