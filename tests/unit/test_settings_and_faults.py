"""Settings parsing, fault specs and CSV defanging: bad input gives a clear, named error."""

from __future__ import annotations

import asyncio
import time

import pytest

from jobrelay.errors import ConfigError, PermanentError, TransientError
from jobrelay.exports.defang import defang
from jobrelay.observe.faults import Faults, parse
from jobrelay.runtime.wiring import build_transport
from jobrelay.settings import load_settings
from jobrelay.transport.rabbitmq import RabbitTransport


def test_defaults_are_the_embedded_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DATABASE_URL", "BROKER_URL", "RESULTS_URL", "MAX_ATTEMPTS", "RETRY_DELAYS"):
        monkeypatch.delenv(f"JOBRELAY_{var}", raising=False)
    s = load_settings()
    assert s.database_url == "sqlite:///./var/jobrelay.db"
    assert s.broker_url == "local" and s.results_url == "file://./var/exports"
    assert (s.max_attempts, s.retry_delays) == (3, (5, 30))


def test_env_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOBRELAY_RETRY_DELAYS", "1, 2,3")
    monkeypatch.setenv("JOBRELAY_MAX_ATTEMPTS", "5")
    s = load_settings(max_attempts="7")
    assert s.retry_delays == (1, 2, 3) and s.max_attempts == 7


@pytest.mark.parametrize(
    ("field", "value", "variable"),
    [
        ("database_url", "mysql://x", "JOBRELAY_DATABASE_URL"),
        ("database_url", "postgresql://u@h1:5432,h2:54x2/db", "JOBRELAY_DATABASE_URL"),
        ("database_url", "postgresql://u:pw@h1:99999/db", "JOBRELAY_DATABASE_URL"),
        ("broker_url", "kafka://x", "JOBRELAY_BROKER_URL"),
        ("broker_url", "amqp://", "JOBRELAY_BROKER_URL"),
        ("results_url", "ftp://x", "JOBRELAY_RESULTS_URL"),
        ("retry_delays", "5,x", "JOBRELAY_RETRY_DELAYS"),
        ("retry_delays", "0", "JOBRELAY_RETRY_DELAYS"),
        ("max_attempts", "0", "JOBRELAY_MAX_ATTEMPTS"),
        ("drain_seconds", "0", "JOBRELAY_DRAIN_SECONDS"),
    ],
)
def test_bad_settings_name_the_variable(field: str, value: str, variable: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(**{field: value})
    assert caught.value.variable == variable
    assert str(caught.value).startswith(variable + ": ")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:secret@h1:5432,h2:54x2/db?target_session_attrs=read-write",
        "postgresql://u:secret@h1:port/db",
        "postgresql://u:secret@h1:5432,/db",
    ],
)
def test_the_library_refuses_a_url_sqlalchemy_cannot_read(url: str) -> None:
    # jobrelay.create_engine does not pass through Settings: the same ConfigError, and the
    # password stays out of the message.
    import jobrelay

    with pytest.raises(ConfigError) as caught:
        jobrelay.create_engine(url)
    assert caught.value.variable == "JOBRELAY_DATABASE_URL"
    assert "secret" not in str(caught.value)


def test_several_hosts_are_libpqs_form_turned_into_sqlalchemys_and_back() -> None:
    """Issue 38: ``h1:p1,h2:p2`` (what libpq, asyncpg and psycopg read) becomes SQLAlchemy's
    ``?host=h1:p1&host=h2:p2``, written only to the primary unless asked otherwise; the raw
    sessions (the listener, the leader's lock, the held connections) get libpq's form back."""
    from jobrelay.storage.engine import async_url, libpq_dsn

    url = async_url("postgresql://u:p%40ss@10.0.0.1:5433,db2.internal:5432/jobs?sslmode=prefer")
    assert url.drivername == "postgresql+asyncpg" and url.database == "jobs"
    assert url.query["host"] == ("10.0.0.1:5433", "db2.internal:5432")
    assert url.query["target_session_attrs"] == "read-write"
    assert url.query["sslmode"] == "prefer"
    dsn = libpq_dsn(url)
    assert dsn.startswith("postgresql://u:p%40ss@10.0.0.1:5433,db2.internal:5432/jobs?")
    assert "target_session_attrs=read-write" in dsn and "sslmode=prefer" in dsn
    assert "host=" not in dsn
    asked = async_url("postgresql://u@h1,h2/jobs?target_session_attrs=any")
    assert asked.query["target_session_attrs"] == "any"
    one = async_url("postgresql://u:secret@h1:5432/jobs")
    assert libpq_dsn(one) == "postgresql://u:secret@h1:5432/jobs"


def test_a_rabbit_consumer_stays_settleable_for_the_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOBRELAY_DRAIN_SECONDS", raising=False)
    assert load_settings().drain_seconds == 60
    monkeypatch.setenv("JOBRELAY_DRAIN_SECONDS", "90")
    settings = load_settings(broker_url="amqp://guest:guest@127.0.0.1:5672/")
    assert settings.drain_seconds == 90
    transport = build_transport(settings, engine=None)  # type: ignore[arg-type]  # unused
    assert isinstance(transport, RabbitTransport) and transport.settle_grace_seconds == 90
    with pytest.raises(ValueError, match="settle_grace_seconds"):
        RabbitTransport(settings.broker_url, transport._topology, settle_grace_seconds=0)


def test_fault_spec_parsing() -> None:
    assert [
        (f.point, f.action, f.n) for f in parse("export.run:crash:2, worker.before_ack:crash")
    ] == [("export.run", "crash", 2), ("worker.before_ack", "crash", None)]
    for bad in ("nope:crash", "export.run:explode", "export.run", "export.run:crash:0"):
        with pytest.raises(ConfigError, match="JOBRELAY_FAULTS"):
            parse(bad)


class Crashed(BaseException):
    pass


def _raise(point: str) -> None:  # stands in for os._exit in a single-process test
    raise Crashed(point)


def test_attempt_faults_fire_only_on_their_attempt() -> None:
    faults = Faults("export.run:transient:1,export.run:invalid:3", crash_handler=_raise)  # type: ignore[arg-type]
    with pytest.raises(TransientError):
        faults.hit("export.run", attempt=1)
    faults.hit("export.run", attempt=2)
    with pytest.raises(PermanentError):
        faults.hit("export.run", attempt=3)


def test_occurrence_faults_count_hits() -> None:
    faults = Faults("worker.before_ack:crash:2", crash_handler=_raise)  # type: ignore[arg-type]
    faults.hit("worker.before_ack")
    with pytest.raises(Crashed):
        faults.hit("worker.before_ack")
    faults.hit("worker.before_ack")


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        ("=1+1", "'=1+1"),
        ("+3", "'+3"),
        ("-2+3", "'-2+3"),
        ("@SUM(A1)", "'@SUM(A1)"),
        ("\tx", "'\tx"),
        ("\rx", "'\rx"),
        ("\nx", "'\nx"),
        ("Refund #3", "Refund #3"),
        ("", ""),
        ("  =1+1", "'  =1+1"),
        ("\u00a0=HYPERLINK(x)", "'\u00a0=HYPERLINK(x)"),
        ("\u200b@SUM(A1)", "'\u200b@SUM(A1)"),
        ("\ufeff+1", "'\ufeff+1"),
        (" \u2060 \u200d-2", "' \u2060 \u200d-2"),
        ("\uff1d1+1", "'\uff1d1+1"),
        ("EUR", "EUR"),
        ("  plain text", "  plain text"),
        ("\u200b", "\u200b"),
        ("   ", "   "),
    ],
)
def test_defang(cell: str, expected: str) -> None:
    assert defang(cell) == expected


def test_fault_selector_narrows_to_matching_jobs() -> None:
    faults = Faults("export.run:invalid@period=2019-12&accountId=acme")
    faults.hit("export.run", attempt=1, params={"accountId": "acme", "period": "2020-01"})
    faults.hit("export.run", attempt=1, params={"accountId": "globex", "period": "2019-12"})
    with pytest.raises(PermanentError):
        faults.hit("export.run", attempt=1, params={"accountId": "acme", "period": "2019-12"})
    with pytest.raises(ConfigError, match="key=value"):
        parse("export.run:invalid@period")


def test_stall_spec_parsing() -> None:
    assert [
        (f.point, f.action, f.seconds, f.n, f.match)
        for f in parse(
            "export.run:stall:20, export.run:stall:2.5:3, export.run:stall:20:1@period=2020-05"
        )
    ] == [
        ("export.run", "stall", 20.0, None, ()),
        ("export.run", "stall", 2.5, 3, ()),
        ("export.run", "stall", 20.0, 1, (("period", "2020-05"),)),
    ]
    assert parse("export.run:crash:2")[0].seconds is None


@pytest.mark.parametrize(
    "bad",
    [
        "export.run:stall",  # no SECONDS
        "export.run:stall@period=2020-05",  # no SECONDS, with a selector
        "export.run:stall:soon",  # not a number
        "export.run:stall:-1",  # negative
        "export.run:stall:0",  # zero
        "export.run:stall:0.0",
        "export.run:stall:nan",
        "export.run:stall:inf",
        "export.run:stall:",  # empty SECONDS
        "export.run:stall:5:0",  # n below 1
        "export.run:stall:5:x",  # n not an integer
        "export.run:stall:5:1:2",  # too many fields
        "export.run:crash:1:2",  # only stall takes SECONDS
        "export.run:transient:2.5:1",
        "notify.after_send:stall:5",  # stall is for export.run and the hand-offs only
        "reconcile.pass:crash",  # a pass only stalls
    ],
)
def test_bad_stall_specs_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError, match="JOBRELAY_FAULTS") as caught:
        parse(bad)
    assert caught.value.variable == "JOBRELAY_FAULTS"


async def test_ahit_stalls() -> None:
    faults = Faults("export.run:stall:0.05")
    started = time.monotonic()
    await faults.ahit("export.run", attempt=1)
    assert time.monotonic() - started >= 0.05


def _fired(caplog: pytest.LogCaptureFixture) -> int:
    """How many ``fault_fired`` warnings were logged (faults warn at WARNING, caplog's default)."""
    return sum(getattr(r, "event", None) == "fault_fired" for r in caplog.records)


async def test_ahit_stalls_only_on_attempt_n(caplog: pytest.LogCaptureFixture) -> None:
    faults = Faults("export.run:stall:0.05:2")
    await faults.ahit("export.run", attempt=1)
    await faults.ahit("export.run", attempt=3)
    assert _fired(caplog) == 0  # neither attempt stalled
    started = time.monotonic()
    await faults.ahit("export.run", attempt=2)
    assert time.monotonic() - started >= 0.05
    assert _fired(caplog) == 1


async def test_ahit_stall_selector_matches_params(caplog: pytest.LogCaptureFixture) -> None:
    faults = Faults("export.run:stall:0.05@period=2020-05")
    await faults.ahit("export.run", attempt=1, params={"period": "2020-06"})
    await faults.ahit("export.run", attempt=1)
    assert _fired(caplog) == 0
    started = time.monotonic()
    await faults.ahit("export.run", attempt=1, params={"period": "2020-05"})
    assert time.monotonic() - started >= 0.05
    assert _fired(caplog) == 1


async def test_ahit_logs_the_stall(caplog: pytest.LogCaptureFixture) -> None:
    faults = Faults("export.run:stall:0.01")
    caplog.clear()
    with caplog.at_level("WARNING", logger="jobrelay.faults"):
        await faults.ahit("export.run", attempt=1)
    assert [getattr(r, "event", None) for r in caplog.records] == ["fault_fired"]
    assert "stall" in caplog.records[0].getMessage()


async def test_cancelling_a_stall_ends_it_promptly() -> None:
    faults = Faults("export.run:stall:60")
    task = asyncio.create_task(faults.ahit("export.run", attempt=1))
    await asyncio.sleep(0.01)  # let it start stalling
    assert not task.done()
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 5  # far below the 60 s stall


async def test_ahit_does_what_hit_does() -> None:
    faults = Faults("export.run:transient:1,export.run:stall:0.01:2,export.run:invalid:2")
    with pytest.raises(TransientError):
        await faults.ahit("export.run", attempt=1)
    with pytest.raises(PermanentError):  # after stalling, in the order of the spec
        await faults.ahit("export.run", attempt=2)
    occurrences = Faults("worker.before_ack:crash:2", crash_handler=_raise)  # type: ignore[arg-type]
    await occurrences.ahit("worker.before_ack")
    with pytest.raises(Crashed):
        await occurrences.ahit("worker.before_ack")


def test_hit_ignores_stall(caplog: pytest.LogCaptureFixture) -> None:
    faults = Faults("export.run:stall:60,export.run:stall:60:1@period=2020-05")
    started = time.monotonic()
    faults.hit("export.run", attempt=1, params={"period": "2020-05"})
    assert time.monotonic() - started < 5  # far below the 60 s stall
    assert _fired(caplog) == 0
    with pytest.raises(TransientError):  # other actions at the point still fire
        Faults("export.run:stall:60,export.run:transient").hit("export.run", attempt=1)
    assert _fired(caplog) == 1  # the transient one only
