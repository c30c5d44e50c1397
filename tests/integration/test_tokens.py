"""Token lifecycle: a revoked or expired token is refused (within the 5 s an API process
remembers a valid token, and from its expiry on), ``last_used_at`` is kept without a write
per request, and listing never shows a secret. SQLite and PostgreSQL, on a test clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

import jobrelay.storage.tokens as tokens_module
from jobrelay.api.auth import hash_token, new_token
from jobrelay.runtime.wiring import Runtime
from jobrelay.storage.tables import api_tokens
from jobrelay.storage.tokens import TOKEN_CACHE_SECONDS
from tests.integration.api_fixtures import Clock, api_client, bearer, build_runtime


class Monotonic:
    """The token cache's clock, moved by the test instead of waited for."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cache_clock(monkeypatch: pytest.MonkeyPatch) -> Monotonic:
    clock = Monotonic()
    monkeypatch.setattr(tokens_module, "_monotonic", clock)
    return clock


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path, clock=Clock())
    yield rt
    await rt.engine.dispose()


async def add(rt: Runtime, expires_in: float | None = None) -> tuple[str, int]:
    token = new_token()
    now = rt.clock()
    expires = None if expires_in is None else now + timedelta(seconds=expires_in)
    token_id = await rt.store.add_token(hash_token(token), "acme", False, now, "ci", expires)
    return token, token_id


async def status(rt: Runtime, token: str) -> int:
    async with api_client(rt) as client:
        return (await client.get("/v1/whoami", headers=bearer(token))).status_code


async def test_a_revoked_token_is_refused_within_the_cache_time(
    runtime: Runtime, cache_clock: Monotonic
) -> None:
    token, token_id = await add(runtime)
    assert await status(runtime, token) == 200
    # Another process revokes it (its own store: this one's cache is not told).
    other = build_runtime(str(runtime.engine.url), Path("/nonexistent"), clock=runtime.clock)
    try:
        revoked = await other.store.revoke_token(token_id)
    finally:
        await other.engine.dispose()
    assert revoked is not None and revoked.revoked_at is not None
    cache_clock.now += TOKEN_CACHE_SECONDS - 0.5
    assert await status(runtime, token) == 200  # still remembered here: at most 5 s
    cache_clock.now += 1.0
    assert await status(runtime, token) == 401
    # Revoking again keeps the first time; an unknown id is None.
    again = await runtime.store.revoke_token(token_id)
    assert again is not None and again.revoked_at == revoked.revoked_at
    assert await runtime.store.revoke_token(999_999) is None


async def test_the_revoking_process_refuses_at_once(
    runtime: Runtime, cache_clock: Monotonic
) -> None:
    token, token_id = await add(runtime)
    assert await status(runtime, token) == 200
    await runtime.store.revoke_token(token_id)
    assert await status(runtime, token) == 401


async def test_an_expired_token_is_refused_from_its_expiry_on(
    runtime: Runtime, cache_clock: Monotonic
) -> None:
    clock = runtime.clock
    assert isinstance(clock, Clock)
    token, _ = await add(runtime, expires_in=2.0)
    assert await status(runtime, token) == 200
    # Remembered only until it expires (2 s), not for the full 5 s.
    clock.advance(2.5)
    cache_clock.now += 2.5
    assert await status(runtime, token) == 401
    expired, _ = await add(runtime, expires_in=-1.0)
    assert await status(runtime, expired) == 401


async def test_last_use_is_kept_without_a_write_per_request(
    runtime: Runtime, cache_clock: Monotonic
) -> None:
    clock = runtime.clock
    assert isinstance(clock, Clock)
    token, token_id = await add(runtime)

    async def last_used() -> object:
        async with runtime.engine.connect() as conn:
            return await conn.scalar(
                select(api_tokens.c.last_used_at).where(api_tokens.c.id == token_id)
            )

    assert await last_used() is None
    assert await status(runtime, token) == 200
    first = await last_used()
    assert first == clock()
    clock.advance(30)
    cache_clock.now += 10  # past the cache: read again, but within the minute: no write
    assert await status(runtime, token) == 200
    assert await last_used() == first
    clock.advance(40)
    cache_clock.now += 10
    assert await status(runtime, token) == 200
    assert await last_used() == clock()


async def test_a_listing_has_everything_but_the_secret(runtime: Runtime) -> None:
    token, token_id = await add(runtime, expires_in=3600)
    (info,) = [t for t in await runtime.store.list_tokens() if t.id == token_id]
    assert (info.account_id, info.label, info.is_admin) == ("acme", "ci", False)
    assert info.state(runtime.clock()) == "active"
    assert info.state(runtime.clock() + timedelta(hours=2)) == "expired"
    shown = repr(info)
    assert token not in shown and hash_token(token) not in shown


async def test_a_revoked_admin_token_can_no_longer_act_at_once(
    runtime: Runtime, cache_clock: Monotonic
) -> None:
    """Admin actions re-read the token past the cache: revoked means refused, no 5 s."""
    token = new_token()
    token_id = await runtime.store.add_token(hash_token(token), None, True, runtime.clock(), "ops")
    async with api_client(runtime) as client:
        job = "0190c9a0-0000-7000-8000-000000000000"
        before = await client.post(
            f"/v1/jobs/{job}/cancel", headers=bearer(token), json={"reason": "test"}
        )
        assert before.status_code == 404  # allowed to ask: no such job
        other = build_runtime(str(runtime.engine.url), Path("/nonexistent"), clock=runtime.clock)
        try:
            await other.store.revoke_token(token_id)
        finally:
            await other.engine.dispose()
        after = await client.post(
            f"/v1/jobs/{job}/cancel", headers=bearer(token), json={"reason": "test"}
        )
        assert after.status_code == 401
