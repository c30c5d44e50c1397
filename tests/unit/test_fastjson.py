"""orjson on the hot path and in the log lines gives the values ``json`` gives (fastjson.py),
and the formatter's lines keep their contract: one JSON object, ASCII, secrets masked."""

from __future__ import annotations

import dataclasses
import json
import logging
from datetime import UTC, datetime
from typing import Any

import pytest

from jobrelay import fastjson
from jobrelay.observe import logs

AWKWARD: list[Any] = [
    {"account": 2**70, "negative": -(2**64) - 1, "exact": 9_007_199_254_740_993},
    {"text": "café ☕ \U0001f600", "escaped": "\u00e9"},
    {"nested": [1, 2.5, None, True, {"k": "v"}]},
    {"float": 0.1, "big": 1e300, "tiny": 5e-324},
]


@pytest.mark.parametrize("value", AWKWARD)
def test_dumps_and_loads_give_the_values_json_gives(value: Any) -> None:
    assert json.loads(fastjson.dumps(value)) == value
    assert fastjson.loads(json.dumps(value)) == json.loads(json.dumps(value))
    assert fastjson.loads(json.dumps(value).encode()) == value


def test_a_long_integer_is_read_as_an_integer_not_a_float() -> None:
    # orjson alone reads 2**70 as 1.1805916207174113e+21: a payload's number would change.
    text = '{"account": 1180591620717411303424, "id": 12345678901234567890}'
    read = fastjson.loads(text)
    assert read == {"account": 2**70, "id": 12345678901234567890}
    assert all(type(v) is int for v in read.values())


def test_lone_surrogates_and_nan_are_read_and_written_as_json_does() -> None:
    assert fastjson.loads('"\\ud800"') == "\ud800"
    assert fastjson.loads('{"x": NaN}')["x"] != fastjson.loads('{"x": NaN}')["x"]  # NaN
    assert fastjson.dumps("\ud800") == '"\\ud800"'
    # Written as null (valid JSON) where json writes NaN, which PostgreSQL refuses.
    assert fastjson.dumps({"x": float("nan")}) == '{"x":null}'


def test_datetimes_dataclasses_and_other_keys_go_through_default_as_with_json() -> None:
    @dataclasses.dataclass
    class Point:
        x: int

    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    value = {"at": at, "point": Point(1), 7: "seven"}
    assert json.loads(fastjson.dumps(value, default=str)) == json.loads(
        json.dumps(value, default=str)
    )
    with pytest.raises(TypeError):
        fastjson.dumps({"at": at})  # no default: refused, as json refuses it


def _line(msg: str, **extra: Any) -> dict[str, Any]:
    record = logging.LogRecord("jobrelay.worker", logging.INFO, "", 0, msg, None, None)
    record.__dict__.update(extra)
    text = logs.JsonFormatter("worker").format(record)
    assert text.isascii() and "\n" not in text
    parsed: dict[str, Any] = json.loads(text)
    return parsed


def test_a_line_is_one_ascii_json_object_with_context_extras_and_time() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    with logs.bound(traceId="t" * 32, jobId="j1"):
        entry = _line("opération échouée", event="released", attempt=2, at=at, n=float("nan"))
    assert entry["msg"] == "opération échouée" and entry["event"] == "released"
    assert entry["traceId"] == "t" * 32 and entry["jobId"] == "j1" and entry["attempt"] == 2
    assert entry["at"] == str(at)  # default=str, as before
    assert entry["level"] == "info" and entry["process"] == "worker"
    now = datetime.now(UTC)
    ts = datetime.fromisoformat(entry["ts"])
    assert ts.tzinfo is not None and abs((now - ts).total_seconds()) < 3600


def test_the_time_is_the_records_to_the_millisecond() -> None:
    record = logging.LogRecord("x", logging.INFO, "", 0, "m", None, None)
    record.created, record.msecs = 1_767_323_045.0429, 42.0
    formatter = logs.JsonFormatter("worker")
    assert json.loads(formatter.format(record))["ts"] == "2026-01-02T03:04:05.042+00:00"
    record.created, record.msecs = 1_767_323_046.5, 500.0  # the next second
    assert json.loads(formatter.format(record))["ts"] == "2026-01-02T03:04:06.500+00:00"


@pytest.mark.parametrize(
    ("msg", "secret"),
    [
        ("token jr_abcdefghijklmnopqrstu used", "jr_abcdefghijklmnopqrstu"),
        ("header BEARER abcdefghijkl", "abcdefghijkl"),
        ("connect amqp://app:s3cret@mq:5672/ failed", "s3cret"),
        ("ünïcode amqp://app:s3cret@mq:5672/", "s3cret"),
    ],
)
def test_secrets_are_still_masked(msg: str, secret: str) -> None:
    entry = _line(msg, detail=msg)
    assert secret not in json.dumps(entry) and "***" in entry["msg"] and "***" in entry["detail"]
