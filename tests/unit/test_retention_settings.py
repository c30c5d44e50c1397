"""Retention settings and ``--older-than`` durations: what is accepted, what is refused."""

from __future__ import annotations

import pytest

from jobrelay.cli.retention import parse_days
from jobrelay.errors import ConfigError
from jobrelay.settings import load_settings


@pytest.mark.parametrize(
    ("text", "days"),
    [("30d", 30), ("12h", 0.5), ("15m", 15 / 1440), ("90s", 90 / 86_400), ("1.5d", 1.5)],
)
def test_older_than_durations(text: str, days: float) -> None:
    assert parse_days(text) == pytest.approx(days)


@pytest.mark.parametrize("text", ["", "30", "d", "0s", "1w", "1d2h", "-3d", "1e3d"])
def test_older_than_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="--older-than"):
        parse_days(text)


def test_retention_defaults_and_a_soak_sized_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOBRELAY_RETENTION_DAYS", raising=False)
    monkeypatch.delenv("JOBRELAY_RETENTION_KEEP_RESULTS", raising=False)
    default = load_settings()
    assert default.retention_days == 30 and default.retention_keep_results is False
    soak = load_settings(retention_days="0.003", retention_keep_results="1")
    assert soak.retention_days == 0.003 and soak.retention_keep_results is True


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_retention_days_must_be_a_positive_number(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(retention_days=value)
    assert caught.value.variable == "JOBRELAY_RETENTION_DAYS"
