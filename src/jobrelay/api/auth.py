"""API tokens: minted once, stored only as a hash, and checked by a hash lookup.

A token is shown to its owner once (``jobrelay token create``) and never stored or logged in
clear: the database keeps its SHA-256. The tokens are 256 random bits, so a plain unsalted
hash is enough (no dictionary to precompute), and looking the hash up by equality in the
database avoids comparing secrets in Python at all.

A token belongs to one account, or is an admin token that may act for every account.

Every unknown token costs a database lookup, so failed authentications are limited per
client address (``JOBRELAY_AUTH_FAILURE_LIMIT``): an address whose bucket is empty is
answered ``429`` for a token that is not valid without looking it up, until the bucket
refills. Only failures are counted, and they lock out only failures: a valid token at that
address (one of the set of valid hashes, ``TokensStore.may_be_valid``, read at most every
few seconds whatever the attacker's rate) is still looked up and served, so 30 made-up
tokens from an address, or from every client behind one proxy, refuse nobody else there.
A token guessed is hopeless anyway (256 random bits); what this bounds is the load.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from jobrelay.api.buckets import RateLimiter
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


def failure_limiter_of(request: Request) -> RateLimiter:
    limiter = getattr(request.app.state, "auth_failure_limiter", None)
    if not isinstance(limiter, RateLimiter):  # an app built without create_app: no limit
        limiter = request.app.state.auth_failure_limiter = RateLimiter(None)
    return limiter


def _client_address(request: Request) -> str:
    # uvicorn's, after JOBRELAY_TRUSTED_PROXIES: a client cannot pick its own bucket.
    return request.client.host if request.client is not None else "unknown"


async def authenticate(
    request: Request,
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
    failures, address = failure_limiter_of(request), _client_address(request)
    token_hash = hash_token(credentials.credentials)
    wait = failures.empty(address)
    if wait is not None and not await runtime.store.may_be_valid(token_hash):
        seconds = max(1, math.ceil(wait))
        raise ProblemError(
            429,
            f"too many requests with a token that is not valid from this address: try again "
            f"in {seconds} s",
            headers={"Retry-After": str(seconds)},
        )
    record = await runtime.store.find_token(token_hash)
    if record is None:
        failures.take(address)
        log.info("unknown API token", extra={"event": "auth_rejected"})
        raise ProblemError(
            401,
            "the API token is not valid",
            headers={"WWW-Authenticate": f'{_CHALLENGE}, error="invalid_token"'},
        )
    return Principal(account_id=record.account_id, is_admin=record.is_admin, key=token_hash)


PrincipalDep = Annotated[Principal, Depends(authenticate)]
