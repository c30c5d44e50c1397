"""The app the soak's processes run by default (``JOBRELAY_APP``): the shipped one, with its
``report.export`` under a concurrency limit per account (issue 36).

So that ``make chaos`` proves the limits too: under kill -9 and restarts, never more than
``ACCOUNT_LIMIT`` exports of one account run at once, and every slot is given back (the
verdict's ``most_running`` and ``slots_at_rest``). Everything else is the shipped app's:
the same export function, parameters, route, tables, e-mail effect and commands (``seed``).
``jobrelay chaos --no-limits`` runs the shipped app itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobrelay import App, ConcurrencyLimit
from jobrelay.effects.notify_email import NOTIFY_EMAIL, NotifyEmail
from jobrelay.exports import ledger, shipped
from jobrelay.exports.report_export import TYPE, ExportParams, download_name, run_export

if TYPE_CHECKING:
    from fastapi import APIRouter

ACCOUNT_LIMIT = 2
SPEC = "jobrelay.chaos.limited_app:app"


def _account(params: ExportParams) -> str:
    return params.account_id


def _router() -> APIRouter:
    from jobrelay.exports.http import export_router  # FastAPI only where HTTP is served

    return export_router(report_export)


app = App()
report_export = app.job(
    TYPE,
    params=ExportParams,
    result_filename=download_name,
    limits=[ConcurrencyLimit(ACCOUNT_LIMIT, key=_account)],
    fair_by=_account,  # as the shipped export is
)(run_export)
app.include(NotifyEmail, type=NOTIFY_EMAIL)
app.http_router(_router)
app.tables(ledger.metadata)
for _name, _command in shipped.app.commands.items():
    app.command(_name)(_command)
