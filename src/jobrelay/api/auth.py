"""API tokens: minted once, stored only as a hash, and checked by a hash lookup.

A token is shown to its owner once (``jobrelay token create``) and never stored or logged in
clear: the database keeps its SHA-256. The tokens are 256 random bits, so a plain unsalted
hash is enough (no dictionary to precompute), and looking the hash up by equality in the
database avoids comparing secrets in Python at all.

A token belongs to one account, or is an admin token that may act for every account.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from jobrelay.api.deps import RuntimeDep
from jobrelay.api.problems import ProblemError

log = logging.getLogger("jobrelay.api")

TOKEN_PREFIX = "jr_"
_CHALLENGE = 'Bearer realm="jobrelay"'

bearer_scheme = HTTPBearer(
    auto_error=False,
    bearerFormat="jr_…",
    description="An API token from `jobrelay token create --account A`.",
)


def new_token() -> str:
    """A fresh token; the prefix makes a leaked one easy to recognise in secret scanners."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: one account, or an admin who may act for any account."""

    account_id: str | None
    is_admin: bool
    # Identifies the token (its hash) for per-token limits; never the token itself.
    key: str = ""

    def may_act_for(self, account_id: str | None) -> bool:
        """Admins act for any job; an account token only for its own account's (never for a
        job enqueued on no account's behalf)."""
        return self.is_admin or (self.account_id is not None and self.account_id == account_id)


async def authenticate(
    runtime: RuntimeDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> Principal:
    """The caller behind ``Authorization: Bearer``; 401 with a challenge otherwise.

    Resolved before the request body is looked at, so an anonymous caller learns nothing
    about what a valid body would be.
    """
    if credentials is None:
        raise ProblemError(
            401,
            "send an API token as 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": _CHALLENGE},
        )
    token_hash = hash_token(credentials.credentials)
    record = await runtime.store.find_token(token_hash)
    if record is None:
        log.info("unknown API token", extra={"event": "auth_rejected"})
        raise ProblemError(
            401,
            "the API token is not valid",
            headers={"WWW-Authenticate": f'{_CHALLENGE}, error="invalid_token"'},
        )
    return Principal(account_id=record.account_id, is_admin=record.is_admin, key=token_hash)


PrincipalDep = Annotated[Principal, Depends(authenticate)]
