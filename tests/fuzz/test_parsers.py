"""Property tests of the two parsers that read input jobrelay does not control.

The message decoder reads whatever a broker delivers: any bytes must give a message or a
``MessageDecodeError`` (quarantined with its reason), never another exception, which would
be a crash loop on one poisoned message. The fault-spec parser reads ``JOBRELAY_FAULTS``:
any string must give faults or a ``ConfigError`` naming the variable (one line at start-up),
never a traceback. Where a format exists, writing a value and reading it back is lossless.
"""

from __future__ import annotations

import json
import uuid

from hypothesis import example, given, settings
from hypothesis import strategies as st

from jobrelay.domain.messages import (
    CURRENT_VERSION,
    JobMessage,
    MessageDecodeError,
    decode,
)
from jobrelay.errors import ConfigError
from jobrelay.observe.faults import POINTS, Fault, parse

KNOWN = frozenset({"report.export", "notify.email"})
PROPERTY = settings(max_examples=400, derandomize=True, deadline=None, database=None)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "jobId": st.uuids().map(str) | st.uuids().map(lambda u: str(u).upper()) | json_values,
        "type": st.sampled_from(sorted(KNOWN)) | json_values,
        "version": st.sampled_from([1, 2, 0, -1, True, 1.0, "1"]) | json_values,
        "extra": json_values,
    },
)
message_like = fields.map(lambda d: json.dumps(d).encode())
bodies = st.binary(max_size=200) | message_like | json_values.map(lambda v: json.dumps(v).encode())


@PROPERTY
@given(bodies)
@example(b"\xff\xfe")  # not UTF-8
@example(b"[" * 100_000)  # deeper than the JSON parser recurses
@example(b'{"version": ' + b"9" * 5000 + b"}")  # an int longer than Python converts
@example(b'{"jobId": "00000000-0000-0000-0000-000000000000", "version": 1e999}')
def test_any_body_decodes_or_gives_the_documented_error(body: bytes) -> None:
    try:
        message = decode(body, KNOWN)
    except MessageDecodeError as exc:
        assert exc.reason and str(exc) == exc.reason
        assert exc.job_id is None or str(uuid.UUID(exc.job_id)) == exc.job_id
        return
    assert isinstance(message, JobMessage)
    assert message.type in KNOWN and message.version == CURRENT_VERSION
    assert str(uuid.UUID(message.job_id)) == message.job_id


@PROPERTY
@given(st.uuids(), st.sampled_from(sorted(KNOWN)))
def test_an_encoded_message_decodes_to_itself(job_id: uuid.UUID, job_type: str) -> None:
    message = JobMessage(job_id=str(job_id), type=job_type)
    assert decode(message.encode(), KNOWN) == message


@PROPERTY
@given(st.uuids(), st.text(min_size=1, max_size=30).filter(lambda t: t not in KNOWN))
def test_an_unknown_type_is_deferred_with_its_job_id(job_id: uuid.UUID, job_type: str) -> None:
    body = JobMessage(job_id=str(job_id), type=job_type).encode()
    try:
        decode(body, KNOWN)
    except MessageDecodeError as exc:
        assert exc.unknown and exc.job_id == str(job_id)
    else:
        raise AssertionError("an unknown type must not decode")


fault_alphabet = st.sampled_from(list(":@&=,.-_ 0123456789abcdefghijklmnopqrstuvwxyz²\u0661\x00é"))
fault_specs = st.text(fault_alphabet, max_size=60) | st.text(max_size=60)


@PROPERTY
@given(fault_specs)
@example("export.run:transient:²")  # a digit to str.isdigit, not to int()
@example("export.run:stall:1e400")
@example("export.run:stall:nan:1")
def test_any_fault_spec_parses_or_names_the_variable(spec: str) -> None:
    try:
        faults = parse(spec)
    except ConfigError as exc:
        assert exc.variable == "JOBRELAY_FAULTS" and exc.problem
        assert "\n" not in exc.problem.replace(repr(spec), "")
        return
    for fault in faults:
        assert fault.action in POINTS[fault.point]
        assert fault.n is None or fault.n >= 1
        assert (fault.seconds is not None) == (fault.action == "stall")


_selector_text = st.text(
    st.sampled_from(list("abcdefghijklmnopqrstuvwxyz0123456789-_.")), min_size=1
)


@st.composite
def faults(draw: st.DrawFn) -> Fault:
    point = draw(st.sampled_from(sorted(POINTS)))
    action = draw(st.sampled_from(sorted(POINTS[point])))
    seconds = draw(st.floats(0.001, 1e6)) if action == "stall" else None
    selectable = point in {"export.run", "api.before_response", "notify.after_send"}
    match = (
        draw(st.lists(st.tuples(_selector_text, _selector_text), max_size=3)) if selectable else []
    )
    return Fault(point, action, draw(st.none() | st.integers(1, 10**6)), tuple(match), seconds)


def spec_of(fault: Fault) -> str:
    """The written form of a fault, as the module docstring gives it."""
    parts = [fault.point, fault.action]
    if fault.seconds is not None:
        parts.append(repr(fault.seconds))
    if fault.n is not None:
        parts.append(str(fault.n))
    selector = "&".join(f"{k}={v}" for k, v in fault.match)
    return ":".join(parts) + (f"@{selector}" if selector else "")


@PROPERTY
@given(st.lists(faults(), max_size=4))
def test_written_faults_read_back_as_they_were(written: list[Fault]) -> None:
    assert parse(", ".join(spec_of(f) for f in written)) == tuple(written)
