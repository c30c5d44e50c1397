"""Settings parsing, fault specs and CSV defanging: bad input gives a clear, named error."""

from __future__ import annotations

import pytest

from jobrelay.errors import ConfigError, PermanentError, TransientError
from jobrelay.faults import Faults, parse
from jobrelay.operations.report_export import defang
from jobrelay.settings import load_settings


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
        ("broker_url", "kafka://x", "JOBRELAY_BROKER_URL"),
        ("broker_url", "amqp://", "JOBRELAY_BROKER_URL"),
        ("results_url", "ftp://x", "JOBRELAY_RESULTS_URL"),
        ("retry_delays", "5,x", "JOBRELAY_RETRY_DELAYS"),
        ("retry_delays", "0", "JOBRELAY_RETRY_DELAYS"),
        ("max_attempts", "0", "JOBRELAY_MAX_ATTEMPTS"),
    ],
)
def test_bad_settings_name_the_variable(field: str, value: str, variable: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(**{field: value})
    assert caught.value.variable == variable
    assert str(caught.value).startswith(variable + ": ")


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
