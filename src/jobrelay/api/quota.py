"""What one account may keep unfinished: ``JOBRELAY_ACCOUNT_MAX_UNFINISHED_JOBS``.

The rate limit bounds how fast a token creates jobs, not how many it keeps: delayed jobs a
year ahead with 16 KB of params each were accepted without end (about 14 GB a day per token
at the default rate). Every API route that accepts jobs for an account (``POST /v1/exports``,
``POST /v1/jobs``, an application's routes through ``AcceptDep``) counts that account's
unfinished jobs first, and over the quota answers ``429`` problem+json naming the limit;
nothing is written. The count is one indexed read (a partial index of the unfinished jobs,
read up to the quota), not a counter kept on every accept and every finish: a counter row
per account would be one more write on both hot paths, and a row every accept and every
completion of the account would queue on. The read is made at most once a second per
account and API process while the account is under its quota (``JobsStore.has_room``): the
accept path of a busy account pays it once a second, not per job.

So the quota is a bound on storage, not a bill: API processes each trust their count for a
second, and may together pass the quota by what the account's tokens are allowed to send
(``JOBRELAY_RATE_LIMIT``) in that second; an account found full is refused for that second
without a read, and a place freed is usable at the next count.
Jobs with no account (an admin token, the library's ``enqueue`` in the application's own
transaction) are not counted: the application is trusted with what it enqueues itself.
"""

from __future__ import annotations

from jobrelay.api.problems import ProblemError, problem_openapi
from jobrelay.runtime.wiring import Runtime

QUOTA_EXCEEDED = "urn:jobrelay:problem:quota-exceeded"
QUOTA_RESPONSES: dict[int | str, dict[str, object]] = {
    429: problem_openapi(
        "Too many requests for this token (JOBRELAY_RATE_LIMIT; Retry-After says when), or "
        "the account has JOBRELAY_ACCOUNT_MAX_UNFINISHED_JOBS unfinished jobs "
        "(urn:jobrelay:problem:quota-exceeded). Nothing was changed."
    )
}


async def within_quota(runtime: Runtime, account_id: str | None, job_id: str) -> None:
    """Nothing when the account may have one more unfinished job, or ``job_id`` exists (a
    retry of a request accepted before: the same job, whatever the count); 429 otherwise."""
    quota = runtime.settings.account_max_unfinished_jobs
    if account_id is None or quota == 0:
        return
    if await runtime.store.has_room(account_id, quota):
        return
    if await runtime.store.job_exists(job_id):
        return
    raise ProblemError(
        429,
        f"this account has {quota} unfinished jobs, its quota: a new one is accepted when "
        "some of them finish or are cancelled",
        type_=QUOTA_EXCEEDED,
        title="Too many unfinished jobs",
        limit=quota,
    )
