"""The pure core: every state transition, every row of the decision table, ids, messages."""

from __future__ import annotations

import itertools
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobrelay.domain.ids import (
    IdKeys,
    Legacy,
    canonical_job_id,
    canonical_json,
    job_id_for,
    keyed_job_id,
    request_hash,
)
from jobrelay.domain.messages import JobMessage, MessageDecodeError, decode
from jobrelay.domain.policy import (
    Action,
    AttemptsExhausted,
    DeliveryForFinished,
    EarlyRetryDelivery,
    InvalidPayload,
    JobView,
    LeaseHeld,
    PermanentFailure,
    ReadyToRun,
    ResultSaved,
    TransientFailure,
    decide,
    observe_delivery,
    retry_delay_for,
)
from jobrelay.domain.states import TRANSITIONS, JobState, can_transition, sources_for

NOW = datetime(2026, 1, 1, tzinfo=UTC)
S = JobState
LEGAL_PIPELINE = {
    (S.QUEUED, S.RUNNING),
    (S.RETRY_WAIT, S.RUNNING),
    (S.RUNNING, S.RUNNING),
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.RETRY_WAIT),
    (S.RUNNING, S.QUARANTINED),
    (S.QUEUED, S.QUARANTINED),
    (S.RETRY_WAIT, S.QUARANTINED),
    # An operator's cancel of a running job is carried out by its worker (or the reconciler).
    (S.RUNNING, S.CANCELLED),
    # Its dependencies have all ended (``after=``); one that failed cancels it there too.
    (S.WAITING, S.QUEUED),
}
LEGAL_OPERATOR = {
    (S.WAITING, S.CANCELLED),
    (S.QUEUED, S.CANCELLED),
    (S.RETRY_WAIT, S.CANCELLED),
    (S.QUARANTINED, S.CANCELLED),
    (S.QUARANTINED, S.QUEUED),
}


@pytest.mark.parametrize(("source", "target"), list(itertools.product(S, S)))
def test_every_pair_of_states(source: JobState, target: JobState) -> None:
    assert can_transition(source, target, by="pipeline") == ((source, target) in LEGAL_PIPELINE)
    assert can_transition(source, target, by="operator") == ((source, target) in LEGAL_OPERATOR)


def test_finished_jobs_never_move_on_a_delivery() -> None:
    for source in (S.SUCCEEDED, S.CANCELLED):
        assert not any(s == source for (s, _t) in TRANSITIONS)
    assert all(who == "operator" for (s, _t), who in TRANSITIONS.items() if s is S.QUARANTINED)


def test_sql_guard_sources() -> None:
    assert sources_for(S.SUCCEEDED) == {S.RUNNING}
    assert sources_for(S.RUNNING) == {S.QUEUED, S.RETRY_WAIT, S.RUNNING}
    assert sources_for(S.QUEUED, by="operator") == {S.QUARANTINED}


def view(state: JobState, **kw: object) -> JobView:
    return JobView(state=state, attempt=kw.pop("attempt", 0), max_attempts=3, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (view(S.QUEUED), ReadyToRun(S.QUEUED)),
        (view(S.SUCCEEDED, result_key="k"), DeliveryForFinished(S.SUCCEEDED, "k")),
        (view(S.QUARANTINED), DeliveryForFinished(S.QUARANTINED, None)),
        (view(S.CANCELLED), DeliveryForFinished(S.CANCELLED, None)),
        (
            view(
                S.RUNNING, attempt=1, lease_owner="w1", lease_expires_at=NOW + timedelta(seconds=9)
            ),
            LeaseHeld("w1"),
        ),
        (
            view(
                S.RUNNING, attempt=1, lease_owner="w1", lease_expires_at=NOW - timedelta(seconds=1)
            ),
            ReadyToRun(S.RUNNING),
        ),
        (
            view(
                S.RUNNING, attempt=3, lease_owner="w1", lease_expires_at=NOW - timedelta(seconds=1)
            ),
            AttemptsExhausted(3, S.RUNNING),
        ),
        (
            view(S.RETRY_WAIT, attempt=1, next_attempt_at=NOW + timedelta(seconds=30)),
            EarlyRetryDelivery(NOW + timedelta(seconds=30)),
        ),
        (
            view(S.RETRY_WAIT, attempt=1, next_attempt_at=NOW + timedelta(milliseconds=500)),
            ReadyToRun(S.RETRY_WAIT),
        ),
    ],
)
def test_observe_delivery(job: JobView, expected: object) -> None:
    assert observe_delivery(job, NOW) == expected


@pytest.mark.parametrize(
    ("observation", "state", "action", "event"),
    [
        (ReadyToRun(S.QUEUED), S.RUNNING, Action.RUN, "claimed"),
        (ResultSaved("k"), S.SUCCEEDED, Action.ACK, "result_saved"),
        (TransientFailure("e", 1, 3, (5, 30)), S.RETRY_WAIT, Action.ACK, "retry_scheduled"),
        (TransientFailure("e", 3, 3, (5, 30)), S.QUARANTINED, Action.REJECT, "quarantined"),
        (PermanentFailure("bad"), S.QUARANTINED, Action.REJECT, "quarantined"),
        (InvalidPayload("x", S.QUEUED), S.QUARANTINED, Action.REJECT, "quarantined"),
        (InvalidPayload("x", None), None, Action.REJECT, "invalid_message"),
        (InvalidPayload("x", S.SUCCEEDED), None, Action.REJECT, "invalid_message"),
        (AttemptsExhausted(3, S.RUNNING), S.QUARANTINED, Action.REJECT, "quarantined"),
        (InvalidPayload("x", S.RUNNING), None, Action.REJECT, "invalid_message"),
        (DeliveryForFinished(S.SUCCEEDED, "k"), None, Action.ACK, "duplicate_acked"),
        (DeliveryForFinished(S.CANCELLED, None), None, Action.ACK, "duplicate_acked"),
        (DeliveryForFinished(S.QUARANTINED, None), None, Action.REJECT, "duplicate_rejected"),
        (LeaseHeld("w"), None, Action.DEFER, "deferred"),
        (EarlyRetryDelivery(NOW), None, Action.ACK, "duplicate_acked"),
    ],
)
def test_decision_table(
    observation: object, state: JobState | None, action: Action, event: str
) -> None:
    decision = decide(observation)  # type: ignore[arg-type]
    assert (decision.new_state, decision.action, decision.event) == (state, action, event)


def test_retry_uses_configured_tiers() -> None:
    assert decide(TransientFailure("e", 1, 5, (5, 30))).retry_delay == 5
    assert decide(TransientFailure("e", 2, 5, (5, 30))).retry_delay == 30
    assert retry_delay_for(4, (5, 30)) == 30
    assert "attempts exhausted (3/3)" in (decide(TransientFailure("e", 3, 3, (5,))).reason or "")


def test_illegal_policy_input_is_refused() -> None:
    with pytest.raises(ValueError, match="illegal transition"):
        decide(ReadyToRun(S.SUCCEEDED))


SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))


def test_job_id_is_stable_and_canonical() -> None:
    a = job_id_for(SECRET, "acme", "report.export", {"accountId": "acme", "period": "2020-05"})
    b = job_id_for(SECRET, "acme", "report.export", {"period": "2020-05", "accountId": "acme"})
    assert a == b
    assert a != job_id_for(
        SECRET, "acme", "report.export", {"accountId": "acme", "period": "2020-06"}
    )
    assert a != job_id_for(
        SECRET, "globex", "report.export", {"accountId": "acme", "period": "2020-05"}
    )
    keyed = job_id_for(SECRET, "acme", "report.export", {"x": 1}, "key-1")
    assert keyed == job_id_for(SECRET, "acme", "report.export", {"y": 2}, "key-1")
    assert keyed != job_id_for(SECRET, "globex", "report.export", {"x": 1}, "key-1")
    assert request_hash("acme", "t", {"a": 1}) != request_hash("acme", "t", {"a": 2})


@given(st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=5))
def test_job_id_ignores_key_order(params: dict[str, object]) -> None:
    reordered = dict(reversed(list(params.items())))
    assert job_id_for(SECRET, "a", "t", params) == job_id_for(SECRET, "a", "t", reordered)


BODY = {"accountId": "acme", "period": "2020-03"}
# The formula the ids had before 0011, with the namespace that was in the source.
OLD_NAMESPACE = uuid.UUID("5b0d3c1e-9f6a-4c55-b7a2-6a1f0e1d2c3b")


def old_formula(material: dict[str, object]) -> str:
    return str(uuid.uuid5(OLD_NAMESPACE, canonical_json(material)))


def test_ids_are_keyed_with_the_secret_and_not_the_old_uuid5() -> None:
    request = job_id_for(SECRET, "acme", "report.export", BODY)
    keyed = job_id_for(SECRET, "acme", "report.export", BODY, "order-42")
    library = keyed_job_id(SECRET, "images.resize", "acme", "img-1")
    # Same secret, same id: a retry is the same job.
    assert request == job_id_for(SECRET, "acme", "report.export", dict(BODY))
    assert library == keyed_job_id(SECRET, "images.resize", "acme", "img-1")
    # Another installation's secret, another id.
    assert request != job_id_for(OTHER_SECRET, "acme", "report.export", BODY)
    assert keyed != job_id_for(OTHER_SECRET, "acme", "report.export", BODY, "order-42")
    assert library != keyed_job_id(OTHER_SECRET, "images.resize", "acme", "img-1")
    # Not what anyone could compute from the source.
    assert request != old_formula({"account": "acme", "type": "report.export", "params": BODY})
    assert keyed != old_formula({"account": "acme", "idempotencyKey": "order-42"})
    assert library != old_formula({"type": "images.resize", "account": "acme", "key": "img-1"})
    for job_id in (request, keyed, library):
        parsed = uuid.UUID(job_id)
        assert parsed.version == 8 and parsed.variant == uuid.RFC_4122
        assert job_id[14] == "8" and canonical_job_id(job_id) == job_id


def test_the_legacy_scheme_is_the_old_formula_and_short_secrets_are_refused() -> None:
    material = {"account": "acme", "type": "report.export", "params": BODY}
    assert job_id_for(Legacy.UUID5, "acme", "report.export", BODY) == old_formula(material)
    keys = IdKeys(SECRET, Legacy.UUID5)
    assert keys.derive(lambda s: job_id_for(s, "acme", "report.export", BODY)) == (
        job_id_for(SECRET, "acme", "report.export", BODY),
        old_formula(material),
    )
    assert IdKeys(SECRET).derive(lambda s: keyed_job_id(s, "t", None, "k"))[1] is None
    assert repr(IdKeys(SECRET, OTHER_SECRET)) == "IdKeys()"  # no secret in a log line
    with pytest.raises(ValueError, match="at least 16 bytes"):
        job_id_for(b"short", "acme", "report.export", BODY)


TYPES = frozenset({"report.export"})
JOB = "0b7f7b8e-6f1c-5d8e-9a3e-1c2d3e4f5a6b"


def test_message_round_trip() -> None:
    message = JobMessage(JOB, "report.export")
    assert decode(message.encode(), TYPES) == message


@pytest.mark.parametrize(
    ("body", "reason", "job_id"),
    [
        (b"{not json", "malformed JSON", None),
        (b"\xff\xfe", "malformed JSON", None),
        (b"[1]", "not a JSON object", None),
        (
            json.dumps({"jobId": "nope", "type": "report.export", "version": 1}).encode(),
            "not a UUID",
            None,
        ),
        (
            json.dumps({"jobId": JOB, "type": "mail.spam", "version": 1}).encode(),
            "unknown job type",
            JOB,
        ),
        (
            json.dumps({"jobId": JOB, "type": "report.export", "version": 2}).encode(),
            "unsupported message version",
            JOB,
        ),
        (
            json.dumps({"jobId": JOB, "type": "report.export", "version": True}).encode(),
            "not an integer",
            JOB,
        ),
        (json.dumps({"jobId": JOB, "type": "report.export"}).encode(), "version missing", JOB),
        (
            json.dumps({"jobId": JOB, "type": "report.export", "version": 1, "x": 1}).encode(),
            "unexpected fields",
            JOB,
        ),
    ],
)
def test_strict_decoding(body: bytes, reason: str, job_id: str | None) -> None:
    with pytest.raises(MessageDecodeError, match=reason) as caught:
        decode(body, TYPES)
    assert caught.value.job_id == job_id


@given(st.binary(max_size=64))
def test_decoding_never_crashes(body: bytes) -> None:
    try:
        message = decode(body, TYPES)
    except MessageDecodeError as exc:
        assert exc.reason
    else:
        assert message.type in TYPES


def test_a_retry_with_its_own_delay_overrides_the_types_delays() -> None:
    asked = decide(TransientFailure("rate limited", 1, 5, (5, 30), delay=42, asked_delay=41.5))
    assert asked.retry_delay == 42 and asked.reason == "rate limited"
    assert decide(TransientFailure("e", 5, 5, (5,), delay=42)).new_state is S.QUARANTINED
