"""The tutorial's tests use jobrelay's pytest plugin: it needs to know the App."""

from __future__ import annotations

import pytest

import jobrelay
from examples.first_job.app import app


@pytest.fixture
def jobrelay_app() -> jobrelay.App:
    return app
