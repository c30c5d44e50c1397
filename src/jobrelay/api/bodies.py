"""Request bodies: read with a size cap, parsed as JSON whatever the Content-Type says.

Every route that takes a body (the core's and an application's, through ``jobrelay.http``)
reads it after authentication with ``read_body`` (413 past ``MAX_BODY_BYTES``) and validates
it with ``parse_body``, so the limits and the 422s are the same everywhere.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from jobrelay.api.problems import ProblemError

MAX_BODY_BYTES = 16 * 1024
M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request) -> bytes:
    """The body, at most ``MAX_BODY_BYTES`` (413). A client gone before its body ended (or
    cut off at ``JOBRELAY_API_BODY_TIMEOUT_SECONDS``, processes/http_guard.py) is a 408 nobody
    reads, not an unhandled error with a traceback in the log."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise ProblemError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:
        raise ProblemError(408, "the request body did not arrive in time") from None
    return bytes(body)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


class _DuplicateKey(ValueError):
    pass


def parse_body(model: type[M], raw: bytes) -> M:
    """Validate a JSON body the way FastAPI would, so its 422 looks like any other.

    Whatever the Content-Type says, the body is read as JSON. Bytes that are not UTF-8 and an
    object with the same key twice are 422s too: JSON parsers disagree on which duplicate
    wins, so a body that means two things to two readers is refused, never resolved. A body
    nested deeper than the parser recurses (16 KiB of ``[`` is 16,000 levels) is a 422 as
    well, not a ``RecursionError``: any token could otherwise cause a 500 and a logged
    traceback. No message quotes the body (http.md: ``detail`` never echoes the input).
    """
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _body_error(f"the body is not UTF-8 (byte {exc.start})", "utf8") from None
    try:
        json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey:
        raise _body_error("an object has the same key twice", "duplicate_key") from None
    except RecursionError:
        raise _body_error("the body is nested too deeply", "too_deep") from None
    except ValueError:
        pass  # not JSON at all: pydantic says so below, in its own words
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = [
            {**error, "loc": ("body", *error["loc"])}
            for error in exc.errors(include_url=False, include_input=False)
        ]
        raise RequestValidationError(errors) from None


def _body_error(message: str, kind: str) -> RequestValidationError:
    return RequestValidationError([{"type": kind, "loc": ("body",), "msg": message}])
