"""Stable job ids that nobody outside the installation can compute.

A job id is a function of who asked and what they asked for, so the same request sent
twice (a retried HTTP call, a double click) lands on the same row instead of making a second
job. With an ``Idempotency-Key`` the key replaces the body as the identity, and the body's
hash is kept to detect a key reused for a different request.

The function is keyed: the first 128 bits of HMAC-SHA256 of the identity under the
installation's secret (``storage/installation.py`` keeps it), shaped as an RFC 9562 UUIDv8.
Before migration 0011 it was a UUIDv5 under a namespace written in this file, so another
tenant could compute "the id of acme's export of 2020-03" and ask for it; ``Legacy.UUID5``
is that scheme, kept only so that a request accepted before the upgrade still finds its job
for a while (the previous scheme of ``IdKeys``). Everything here is pure: the secret is
given, never read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# The UUIDv5 namespace of the legacy ids, and still of follow-up ids (see follow_up_job_id).
_NAMESPACE = uuid.UUID("5b0d3c1e-9f6a-4c55-b7a2-6a1f0e1d2c3b")
MIN_SECRET_BYTES = 16


class Legacy(Enum):
    """The id scheme before migration 0011: UUIDv5 under ``_NAMESPACE``, no secret."""

    UUID5 = "legacy-uuid5"


# What an id is derived with: a secret (HMAC-SHA256, UUIDv8), or the legacy scheme.
IdSecret = bytes | Legacy


@dataclass(frozen=True)
class IdKeys:
    """The secrets ids are derived with at one moment: the installation's current one, and
    the previous one while a rotation's window still counts (``None`` otherwise). Neither is
    ever part of a ``repr``."""

    current: bytes = field(repr=False)
    previous: IdSecret | None = field(default=None, repr=False)

    def derive(self, derive: Callable[[IdSecret], str]) -> tuple[str, str | None]:
        """``derive`` under the current secret, and under the previous one if it counts."""
        return derive(self.current), None if self.previous is None else derive(self.previous)


def canonical_json(value: Any) -> str:
    """One spelling per value: sorted keys, no spaces, UTF-8 kept as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def request_hash(
    account_id: str | None,
    job_type: str,
    params: dict[str, Any],
    when: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> str:
    """Digest of the request body, kept with the job to detect a reused idempotency key.

    Unkeyed, so it must never be shown as an id or to an account: it is stored, compared
    with the next request's under the same id, and read by nothing else.

    ``when`` is the run time as the request asked for it (``domain.delays.requested``): part
    of the request, so the same key with another run time is a conflict. Absent, the digest
    is the one jobs had before delays existed. ``after``: the jobs it runs after, the same
    way (``domain.dependencies``).
    """
    body: dict[str, Any] = {"account": account_id, "type": job_type, "params": params}
    if when:
        body["when"] = when
    if after:
        body["after"] = after
    material = canonical_json(body)
    return hashlib.sha256(material.encode()).hexdigest()


def job_id_for(
    secret: IdSecret,
    account_id: str | None,
    job_type: str,
    params: dict[str, Any],
    idempotency_key: str | None = None,
) -> str:
    """The job id of a request: from the key when one is given, else from the body."""
    if idempotency_key is not None:
        material = canonical_json({"account": account_id, "idempotencyKey": idempotency_key})
    else:
        material = canonical_json({"account": account_id, "type": job_type, "params": params})
    return _derive(secret, material)


def keyed_job_id(secret: IdSecret, job_type: str, account_id: str | None, key: str) -> str:
    """The id of a library job enqueued with ``key``: one job per (type, account, key)."""
    return _derive(secret, canonical_json({"type": job_type, "account": account_id, "key": key}))


def _derive(secret: IdSecret, material: str) -> str:
    if isinstance(secret, Legacy):
        return str(uuid.uuid5(_NAMESPACE, material))
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"an id secret has at least {MIN_SECRET_BYTES} bytes")
    digest = hmac.new(secret, material.encode(), hashlib.sha256).digest()
    return _shaped(int.from_bytes(digest[:16], "big"), version=8)


def _shaped(value: int, version: int) -> str:
    """128 bits as an RFC 9562 UUID of ``version`` (variant 10), hyphenated, lowercase."""
    value = value & ~(0xF << 76) | (version << 76)
    value = value & ~(0x3 << 62) | (0x2 << 62)
    return str(uuid.UUID(int=value))


def uuid7() -> str:
    """A fresh time-ordered id (RFC 9562 UUIDv7): new rows land at the end of the index.

    48 bits of Unix milliseconds, then the version, 74 random bits and the variant.
    """
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    return _shaped((millis & ((1 << 48) - 1)) << 80 | rand & ((1 << 80) - 1), version=7)


def follow_up_job_id(parent_job_id: str, job_type: str) -> str:
    """The id of the one ``job_type`` job that ``parent_job_id`` may create when it succeeds.

    A function of the parent's id alone, so a second "succeeded" for the same parent (a
    duplicate delivery, a lease takeover) lands on the existing follow-up instead of
    creating another one: one export, at most one notification.

    Not keyed with the installation's secret, on purpose: it must not change when the
    secret is rotated between two successes of one parent (that would be a second
    notification), and it needs no secret to be unguessable, because the parent's id is
    already keyed (or random, UUIDv7): whoever cannot compute the parent's id cannot compute
    this one. An application that passes its own guessable ``job_id`` gets guessable
    follow-ups too.
    """
    material = canonical_json({"parent": parent_job_id, "type": job_type})
    return str(uuid.uuid5(_NAMESPACE, material))


def canonical_job_id(raw: str) -> str | None:
    """The canonical spelling of a jobId given by a person, or None unless it is a
    hyphenated UUID.

    ``uuid.UUID`` also takes braces, ``urn:uuid:`` and bare hex; only the one form we hand
    out is accepted (in either case), so each job has exactly one URL, and the CLI takes
    exactly what the API takes.
    """
    try:
        canonical = str(uuid.UUID(raw))
    except ValueError:
        return None
    return canonical if canonical == raw.lower() else None
