"""API tokens, stored only as hashes."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    insert,
    select,
)

from jobrelay.storage.base import StoreBase
from jobrelay.storage.records import (
    TokenRecord,
)
from jobrelay.storage.tables import (
    api_tokens,
)


class TokensStore(StoreBase):
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
        async with self.reading() as conn:
            row = (
                await conn.execute(
                    select(api_tokens.c.account_id, api_tokens.c.is_admin).where(
                        api_tokens.c.token_hash == token_hash
                    )
                )
            ).first()
        return TokenRecord(row.account_id, bool(row.is_admin)) if row else None
