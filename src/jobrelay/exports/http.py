"""``POST /v1/exports``: the export app's own route (``app.http_router``), on ``jobrelay.http``.

Accepting writes the job, its outbox row and its ``accepted`` event in ONE transaction; the
202 is sent only after that commit, so a client that saw a jobId can always read it back.
The jobId is a function of the request (the account and the body, or the account and the
``Idempotency-Key``), keyed with the installation's secret: the same request twice is the
same job, and no other tenant can compute it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ConfigDict, Field, field_validator

from jobrelay.effects.notify_email import MAX_ADDRESS_LENGTH, check_address
from jobrelay.exports.report_export import ExportParams
from jobrelay.http import (
    ACCEPT_RESPONSES,
    MAX_BODY_BYTES,
    AcceptDep,
    Accepted,
    CallerDep,
    IdempotencyKey,
    ProblemError,
    TraceParent,
    ValidationProblem,
    WireModel,
    parse_body,
    problem_openapi,
    read_body,
)
from jobrelay.library.job_definition import JobDefinition

ACCOUNT_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
# The schema states the server's rule exactly (1900-01 to 2999-12), so a client generated
# from the OpenAPI document refuses 0000-00 too.
PERIOD_PATTERN = r"^(19[0-9]{2}|2[0-9]{3})-(0[1-9]|1[0-2])$"
FIRST_PERIOD, LAST_PERIOD = (1900, 1), (2999, 12)


class ExportRequest(WireModel):
    # Only the camelCase wire names are accepted: "account_id" is an unknown field here.
    model_config = ConfigDict(extra="forbid", validate_by_name=False)

    account_id: str = Field(
        pattern=ACCOUNT_PATTERN,
        description="Lowercase letters, digits, '_' and '-'; 1-64 characters.",
        examples=["acme"],
    )
    period: str = Field(
        pattern=PERIOD_PATTERN,
        description="A calendar month, YYYY-MM, from 1900-01 to 2999-12.",
        examples=["2020-05"],
    )
    notify_email: str | None = Field(
        default=None,
        max_length=MAX_ADDRESS_LENGTH,
        description=(
            "Optional. One plain address (name@example.com, at most 254 characters, no display "
            "name, no list) that gets one e-mail with a link to the result once the export "
            "has succeeded. Part of the request's identity: it changes the jobId."
        ),
        examples=["ops@example.com"],
    )

    @field_validator("notify_email")
    @classmethod
    def _single_address(cls, value: str | None) -> str | None:
        return None if value is None else check_address(value)

    @field_validator("period")
    @classmethod
    def _real_month(cls, value: str) -> str:
        year, month = int(value[:4]), int(value[5:])
        if not 1 <= month <= 12:
            raise ValueError("month must be 01-12")
        if not FIRST_PERIOD <= (year, month) <= LAST_PERIOD:
            raise ValueError("period must be between 1900-01 and 2999-12")
        return value

    def params(self) -> dict[str, Any]:
        """The job's stored parameters: the wire fields given, in wire spelling.

        ``notifyEmail`` is stored only when given, so a request without it keeps the jobId
        it always had.
        """
        params = {"accountId": self.account_id, "period": self.period}
        if self.notify_email is not None:
            params["notifyEmail"] = self.notify_email
        return params


def export_router(report_export: JobDefinition[ExportParams]) -> APIRouter:
    """The route, accepting ``report_export``: handed in by the app that defines it (and
    imports this module), so this module does not import the app."""
    router = APIRouter()

    @router.post(
        "/v1/exports",
        status_code=202,
        response_model=Accepted,
        summary="Accept a report.export job",
        responses={
            **ACCEPT_RESPONSES,
            403: problem_openapi("The token may not act for this accountId."),
            413: problem_openapi(f"The body is larger than {MAX_BODY_BYTES} bytes."),
            422: problem_openapi(
                "Invalid body or header, or an Idempotency-Key reused with another body.",
                ValidationProblem,
            ),
        },
        # The body is parsed in the handler (after authentication), so it is declared here.
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ExportRequest.model_json_schema()}},
            }
        },
    )
    async def create_export(
        request: Request,
        response: Response,
        caller: CallerDep,
        accept: AcceptDep,
        idempotency_key: IdempotencyKey = None,
        traceparent: TraceParent = None,
    ) -> Accepted:
        body = parse_body(ExportRequest, await read_body(request))
        if not caller.may_act_for(body.account_id):
            raise ProblemError(403, "this token may not act for that account")
        params = body.params()
        # The trace (the caller's ``traceparent``, our request span) is the request's
        # context: the enqueue takes it from there (``observe.tracing.enqueuing``).
        del traceparent
        admission = await accept(
            report_export,
            params,
            account=body.account_id,
            key=idempotency_key,
            by_request=True,
        )
        status_url = f"/v1/jobs/{admission.job_id}"
        response.headers["Location"] = status_url
        return Accepted(job_id=admission.job_id, status_url=status_url)

    return router
