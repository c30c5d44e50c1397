"""The pages a newcomer reads before choosing where results go name every scheme the settings
accept (issue 34, item 19: they said ``file://`` was the only one while ``s3://`` worked)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobrelay.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/how-to/run-on-postgres-rabbitmq.md")
ACCEPTED = {"file": "file:///srv/jobrelay/exports", "s3": "s3://acme-exports/jobrelay"}


@pytest.mark.parametrize("page", PAGES)
def test_a_page_on_results_names_every_accepted_scheme(page: str) -> None:
    text = (ROOT / page).read_text()
    for scheme, example in ACCEPTED.items():
        assert load_settings(results_url=example).results_url == example  # it is accepted
        assert f"`{scheme}://" in text, (page, scheme)
    flat = " ".join(text.split())
    assert not re.search(r"only results scheme|only scheme", flat), page
