"""jobrelay's pytest plugin is loaded in every test session of a project that installs
jobrelay: loading it must not import the runtime (SQLAlchemy, the broker client, the App)."""

from __future__ import annotations

import subprocess
import sys


def test_loading_the_plugin_imports_nothing_heavy() -> None:
    heavy = ("sqlalchemy", "aio_pika", "jobrelay.library.app", "jobrelay.runtime.wiring")
    code = f"import sys, jobrelay.testing.plugin; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_the_plugin_is_registered_for_pytest() -> None:
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="pytest11")}
    assert found.get("jobrelay") == "jobrelay.testing.plugin"
