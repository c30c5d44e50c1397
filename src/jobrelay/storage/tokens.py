"""API tokens, stored only as hashes, with an expiry, a revocation and a last use.

A token is valid while it is not revoked and its expiry (if any) is ahead, by the store's
clock. A token found valid is remembered by this process for ``TOKEN_CACHE_SECONDS`` (or
until it expires, if sooner): the API then authenticates a busy client without a database
round trip per request. A token revoked (or deleted) therefore keeps working for up to that
long in each API process that saw it, never longer; an expired one stops at its expiry.
Unknown, revoked and expired tokens are never remembered, so a token just created works at
once and a refused one is asked about again next time.

``last_used_at`` is refreshed when a lookup finds it more than ``LAST_USED_PRECISION`` old:
at most one small write a minute per token and process, never one per request.

``may_be_valid`` answers from the hashes of every valid token, read in one statement at most
once per ``TOKEN_CACHE_SECONDS`` and only when asked: the API asks it for an address that
sent too many bad tokens, so that a valid token there is still looked up and served while a
made-up one costs no lookup at all (issue 34, item 12). The tokens of an installation are
few (made by an operator); their hashes are 64 bytes each.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.storage.base import StoreBase
from jobrelay.storage.records import Clock, TokenInfo, TokenRecord
from jobrelay.storage.tables import api_tokens

TOKEN_CACHE_SECONDS = 5.0
LAST_USED_PRECISION = timedelta(minutes=1)
_TOKEN_CACHE_SIZE = 10_000  # beyond that, start again (a flood of distinct tokens is rare)
_monotonic = time.monotonic  # the cache's clock (tests move it)


class TokensStore(StoreBase):
    def __init__(
        self, engine: AsyncEngine, *, clock: Clock | None = None, id_secret: bytes | None = None
    ) -> None:
        super().__init__(engine, clock=clock, id_secret=id_secret)
        self._known_tokens: dict[str, tuple[float, TokenRecord]] = {}
        self._valid_hashes: frozenset[str] = frozenset()
        self._valid_hashes_until = float("-inf")
        self._valid_hashes_lock = asyncio.Lock()

    async def add_token(
        self,
        token_hash: str,
        account_id: str | None,
        is_admin: bool,
        now: datetime,
        label: str | None = None,
        expires_at: datetime | None = None,
    ) -> int:
        """Store a new token's hash; its id (what ``token list`` and ``token revoke`` use)."""
        async with self.writing() as conn:
            result = await conn.execute(
                insert(api_tokens)
                .values(
                    token_hash=token_hash,
                    account_id=account_id,
                    is_admin=is_admin,
                    label=label,
                    created_at=now,
                    expires_at=expires_at,
                )
                .returning(api_tokens.c.id)
            )
            return int(result.scalar_one())

    async def find_token(self, token_hash: str) -> TokenRecord | None:
        """The valid token's record, from this process's memory if it was found lately."""
        now = _monotonic()
        known = self._known_tokens.get(token_hash)
        if known is not None and known[0] > now:
            return known[1]
        found = await self._read_token(token_hash)
        if found is None:
            self._known_tokens.pop(token_hash, None)
            return None
        record, remaining = found
        if len(self._known_tokens) >= _TOKEN_CACHE_SIZE:
            self._known_tokens.clear()
        self._known_tokens[token_hash] = (now + min(TOKEN_CACHE_SECONDS, remaining), record)
        return record

    async def may_be_valid(self, token_hash: str) -> bool:
        """Whether the token was valid at most ``TOKEN_CACHE_SECONDS`` ago (a revoked one may
        still say yes: ``find_token`` decides). Concurrent callers share one reading."""
        if token_hash in self._known_tokens:
            return True
        async with self._valid_hashes_lock:
            if self._valid_hashes_until <= _monotonic():
                async with self.reading() as conn:
                    rows = await conn.execute(select(api_tokens.c.token_hash).where(*self._valid()))
                    self._valid_hashes = frozenset(row.token_hash for row in rows)
                self._valid_hashes_until = _monotonic() + TOKEN_CACHE_SECONDS
        return token_hash in self._valid_hashes

    def _valid(self) -> list[ColumnElement[bool]]:
        return [
            api_tokens.c.revoked_at.is_(None),
            or_(api_tokens.c.expires_at.is_(None), api_tokens.c.expires_at > self.now_sql()),
        ]

    async def _read_token(self, token_hash: str) -> tuple[TokenRecord, float] | None:
        """The record of a valid token and how many seconds it stays valid (inf: no expiry);
        refreshes ``last_used_at`` when it is stale."""
        async with self.reading() as conn:
            row = (
                await conn.execute(
                    select(
                        api_tokens.c.id,
                        api_tokens.c.account_id,
                        api_tokens.c.is_admin,
                        api_tokens.c.expires_at,
                        api_tokens.c.last_used_at,
                        self.now_sql().label("now"),
                    ).where(api_tokens.c.token_hash == token_hash, *self._valid())
                )
            ).first()
        if row is None:
            return None
        now: datetime = row.now
        if row.last_used_at is None or now - row.last_used_at > LAST_USED_PRECISION:
            async with self.writing() as conn:
                await conn.execute(
                    update(api_tokens).where(api_tokens.c.id == row.id).values(last_used_at=now)
                )
        remaining = (
            float("inf") if row.expires_at is None else (row.expires_at - now).total_seconds()
        )
        return TokenRecord(row.account_id, bool(row.is_admin), row.expires_at), remaining

    async def token_identity(self, token_hash: str) -> tuple[int, str | None] | None:
        """A valid token's row id and label, to name who did an operator action (never the
        token). Read on every admin action, past the cache: a revoked or expired admin token
        can no longer act from the moment it is revoked."""
        async with self.reading() as conn:
            row = (
                await conn.execute(
                    select(api_tokens.c.id, api_tokens.c.label).where(
                        api_tokens.c.token_hash == token_hash, *self._valid()
                    )
                )
            ).first()
        return (int(row.id), row.label) if row is not None else None

    async def list_tokens(self, token_id: int | None = None) -> list[TokenInfo]:
        """Every token (or the one with ``token_id``), oldest first, without its hash."""
        query = select(
            api_tokens.c.id,
            api_tokens.c.account_id,
            api_tokens.c.is_admin,
            api_tokens.c.label,
            api_tokens.c.created_at,
            api_tokens.c.last_used_at,
            api_tokens.c.expires_at,
            api_tokens.c.revoked_at,
        ).order_by(api_tokens.c.id)
        if token_id is not None:
            query = query.where(api_tokens.c.id == token_id)
        async with self.reading() as conn:
            rows = (await conn.execute(query)).all()
        return [TokenInfo(**row._mapping) for row in rows]

    async def revoke_token(self, token_id: int) -> TokenInfo | None:
        """Revoke the token (once: a second revoke keeps the first time); None if no such id."""
        async with self.writing() as conn:
            await conn.execute(
                update(api_tokens)
                .where(api_tokens.c.id == token_id, api_tokens.c.revoked_at.is_(None))
                .values(revoked_at=self.now_sql())
            )
        # This process forgets it at once; other API processes within the cache time.
        self._known_tokens.clear()
        found = await self.list_tokens(token_id)
        return found[0] if found else None
