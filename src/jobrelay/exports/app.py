"""The shipped app, as ``jobrelay.exports.app:app``: what runs when no ``--app`` is given.

Its two job types still use the lower-level ``Operation`` port (``App.include``); moving them
onto ``@app.job`` is tracked with the rest of the example app's move out of the core.
"""

from __future__ import annotations

from jobrelay.app import App
from jobrelay.effects.notify_email import NotifyEmail
from jobrelay.exports.report_export import ReportExport
from jobrelay.settings import Settings


def _report_export(settings: Settings) -> ReportExport:
    return ReportExport()


app = App()
app.include(_report_export)
app.include(NotifyEmail)
