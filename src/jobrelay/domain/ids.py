"""Stable job ids.

A job id is a pure function of who asked and what they asked for, so the same request sent
twice (a retried HTTP call, a double click) lands on the same row instead of making a second
job. With an ``Idempotency-Key`` the key replaces the body as the identity, and the body's
hash is kept to detect a key reused for a different request.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

_NAMESPACE = uuid.UUID("5b0d3c1e-9f6a-4c55-b7a2-6a1f0e1d2c3b")


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


def request_hash(account_id: str | None, job_type: str, params: dict[str, Any]) -> str:
    """Digest of the request body, kept with the job to detect a reused idempotency key."""
    material = canonical_json({"account": account_id, "type": job_type, "params": params})
    return hashlib.sha256(material.encode()).hexdigest()


def job_id_for(
    account_id: str,
    job_type: str,
    params: dict[str, Any],
    idempotency_key: str | None = None,
) -> str:
    """The job id for a request: from the key when one is given, else from the body."""
    if idempotency_key is not None:
        material = canonical_json({"account": account_id, "idempotencyKey": idempotency_key})
    else:
        material = canonical_json({"account": account_id, "type": job_type, "params": params})
    return str(uuid.uuid5(_NAMESPACE, material))


def keyed_job_id(job_type: str, account_id: str | None, key: str) -> str:
    """The id of a library job enqueued with ``key``: one job per (type, account, key)."""
    material = canonical_json({"type": job_type, "account": account_id, "key": key})
    return str(uuid.uuid5(_NAMESPACE, material))


def uuid7() -> str:
    """A fresh time-ordered id (RFC 9562 UUIDv7): new rows land at the end of the index.

    48 bits of Unix milliseconds, then the version, 74 random bits and the variant.
    """
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & ((1 << 48) - 1)) << 80 | rand & ((1 << 80) - 1)
    value = value & ~(0xF << 76) | (0x7 << 76)  # version 7
    value = value & ~(0x3 << 62) | (0x2 << 62)  # variant 10
    return str(uuid.UUID(int=value))


def follow_up_job_id(parent_job_id: str, job_type: str) -> str:
    """The id of the one ``job_type`` job that ``parent_job_id`` may create when it succeeds.

    A function of the parent's id alone, so a second "succeeded" for the same parent (a
    duplicate delivery, a lease takeover) lands on the existing follow-up instead of
    creating another one: one export, at most one notification.
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
