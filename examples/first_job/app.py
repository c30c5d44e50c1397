"""The jobrelay App of the tutorial and its one job type, ``welcome.send``.

Run it with ``jobrelay up --app examples.first_job.app:app`` from the repository root.
"""

from __future__ import annotations

from pydantic import BaseModel

import jobrelay

app = jobrelay.App()  # settings from JOBRELAY_* (default: ./var/jobrelay.db, local transport)


class Welcome(BaseModel):
    signup_id: int
    email: str


@app.job("welcome.send", params=Welcome, max_attempts=3, retry_delays=(5,))
async def send_welcome(
    ctx: jobrelay.JobContext[Welcome], params: Welcome
) -> jobrelay.Result | None:
    if "@" not in params.email:
        raise jobrelay.Permanent(f"not an email address: {params.email!r}")
    ctx.log.info("welcoming %s (attempt %d)", params.email, ctx.attempt)
    key = ctx.result_key("welcome.txt")  # the same key on every attempt
    async with ctx.writer(key) as out:
        await out.write(f"Welcome aboard, {params.email}!\n".encode())
    # The file is the welcome; the value is what the caller reads back (``app.result``).
    return jobrelay.Result(key=key, value={"signupId": params.signup_id, "welcomed": True})
