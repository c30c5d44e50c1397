"""API tokens, stored only as hashes.

A token found is remembered by this process for ``TOKEN_CACHE_SECONDS``: the API then
authenticates a busy client without a database round trip per request. A token whose row
is deleted therefore keeps working for up to that long in each API process that saw it
(the admin endpoints re-read it every time). Unknown tokens are never remembered: a token
just created works at once.
"""

from __future__ import annotations

import time
from datetime import datetime

from sqlalchemy import (
    insert,
    select,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from jobrelay.storage.base import StoreBase
from jobrelay.storage.records import (
    Clock,
    TokenRecord,
)
from jobrelay.storage.tables import (
    api_tokens,
)

TOKEN_CACHE_SECONDS = 5.0
_TOKEN_CACHE_SIZE = 10_000  # beyond that, start again (a flood of distinct tokens is rare)
_monotonic = time.monotonic  # the cache's clock (tests move it)


class TokensStore(StoreBase):
    def __init__(self, engine: AsyncEngine, *, clock: Clock | None = None) -> None:
        super().__init__(engine, clock=clock)
        self._known_tokens: dict[str, tuple[float, TokenRecord]] = {}

    async def add_token(
        self,
        token_hash: str,
        account_id: str | None,
        is_admin: bool,
        now: datetime,
        label: str | None = None,
    ) -> None:
        async with self.writing() as conn:
            await conn.execute(
                insert(api_tokens).values(
                    token_hash=token_hash,
                    account_id=account_id,
                    is_admin=is_admin,
                    label=label,
                    created_at=now,
                )
            )

    async def find_token(self, token_hash: str) -> TokenRecord | None:
        """The token's record, from this process's memory if it was found lately."""
        now = _monotonic()
        known = self._known_tokens.get(token_hash)
        if known is not None and known[0] > now:
            return known[1]
        record = await self._read_token(token_hash)
        if record is None:
            self._known_tokens.pop(token_hash, None)
            return None
        if len(self._known_tokens) >= _TOKEN_CACHE_SIZE:
            self._known_tokens.clear()
        self._known_tokens[token_hash] = (now + TOKEN_CACHE_SECONDS, record)
        return record

    async def _read_token(self, token_hash: str) -> TokenRecord | None:
        async with self.reading() as conn:
            row = (
                await conn.execute(
                    select(api_tokens.c.account_id, api_tokens.c.is_admin).where(
                        api_tokens.c.token_hash == token_hash
                    )
                )
            ).first()
        return TokenRecord(row.account_id, bool(row.is_admin)) if row else None
