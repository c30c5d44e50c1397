"""What a reconciler pass found (``maintenance.reconcile``): the kinds of finding, one
finding, and the pass's report as ``jobrelay reconcile`` and the overview show it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

LEASE_EXPIRED = "lease_expired"
RETRY_OVERDUE = "retry_overdue"
QUEUED_UNCLAIMED = "queued_unclaimed"
OUTBOX_STALE = "outbox_stale"
QUARANTINE_MISMATCH = "quarantine_mismatch"
NOT_CONSUMING = "not_consuming"
FINDINGS = (
    LEASE_EXPIRED,
    RETRY_OVERDUE,
    QUEUED_UNCLAIMED,
    OUTBOX_STALE,
    QUARANTINE_MISMATCH,
    NOT_CONSUMING,
)


@dataclass(frozen=True)
class Finding:
    kind: str
    job_id: str | None
    detail: str
    repaired: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "jobId": self.job_id,
            "detail": self.detail,
            "repaired": self.repaired,
        }


@dataclass
class Report:
    dry_run: bool
    findings: list[Finding] = field(default_factory=list)
    quarantine_scanned: int | None = None  # None: the quarantine queue was not read

    @property
    def repaired(self) -> int:
        return sum(1 for f in self.findings if f.repaired)

    def counts(self) -> dict[str, int]:
        seen = Counter(f.kind for f in self.findings)
        return {kind: seen.get(kind, 0) for kind in FINDINGS}

    def as_dict(self) -> dict[str, Any]:
        return {
            "dryRun": self.dry_run,
            "counts": self.counts(),
            "repaired": self.repaired,
            "quarantineScanned": self.quarantine_scanned,
            "findings": [f.as_dict() for f in self.findings],
        }
