"""``worker.failures``: what a failed attempt's traceback is stored as (scrubbed, storable, at
most 8 KiB of UTF-8 with its end kept). The worker's side is in
tests/integration/test_failure_traceback.py."""

from __future__ import annotations

from jobrelay.worker.failures import CUT_MARKER, MAX_TRACEBACK_BYTES, bounded, failure_traceback


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_a_short_traceback_is_kept_whole_with_its_chain() -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as exc:
            raise RuntimeError("outer") from exc
    except RuntimeError as exc:
        text = failure_traceback(exc)
    assert text is not None
    assert "KeyError: 'inner'" in text and "direct cause" in text
    assert text.endswith("RuntimeError: outer\n")
    assert not text.startswith(CUT_MARKER)


def test_secrets_are_masked_and_nul_and_surrogates_escaped() -> None:
    message = (
        "postgresql://app:hunter2@db/app amqp://guest:guest@mq// "
        "Authorization: Bearer abcdefgh12345678 jr_0123456789abcdefXYZ nul\x00 lone\udc80"
    )
    text = failure_traceback(_raised(ValueError(message)))
    assert text is not None
    for secret in ("hunter2", ":guest@", "abcdefgh12345678", "jr_0123456789abcdef", "\x00"):
        assert secret not in text, secret
    assert "postgresql://app:***@db/app" in text and "Bearer ***" in text and "jr_***" in text
    assert "nul\\x00 lone\\udc80" in text
    text.encode("utf-8")  # storable: no lone surrogate left


def test_a_long_text_keeps_its_end_from_a_line_start_under_the_limit() -> None:
    lines = [f'  File "job.py", line {n}, in step_{n}\n' for n in range(1000)]
    text = bounded("Traceback (most recent call last):\n" + "".join(lines) + "ValueError: last\n")
    assert len(text.encode("utf-8")) <= MAX_TRACEBACK_BYTES
    assert text.startswith(CUT_MARKER)
    assert text.endswith("in step_999\nValueError: last\n")
    assert text[len(CUT_MARKER) :].startswith('  File "job.py"')  # a whole line after the marker


def test_the_cut_never_splits_a_character_and_keeps_a_huge_last_line() -> None:
    text = bounded("Traceback\n" + "é" * 10_000 + " the end\n")
    assert len(text.encode("utf-8")) <= MAX_TRACEBACK_BYTES
    assert text.startswith(CUT_MARKER) and text.endswith("éé the end\n")
    assert "\ufffd" not in text
    assert bounded("short\n") == "short\n"
