"""What ``after=`` asks for, checked before anything is written (``domain.dependencies``)."""

from __future__ import annotations

import pytest

from jobrelay.domain.dependencies import dependencies_of
from jobrelay.errors import InvalidDependencies


def test_each_id_once_in_the_order_first_named() -> None:
    deps = dependencies_of(["b", "a", "b", "c"], "cancel", 10)
    assert deps.ids == ("b", "a", "c")
    assert deps.requested == {"after": ["b", "a", "c"], "afterFailure": "cancel"}
    assert dependencies_of([], "cancel", 10).requested is None  # the hash jobs had before


@pytest.mark.parametrize(
    ("after", "failure", "says"),
    [
        ("0193-one-id", "cancel", "not a single string"),
        (["a", ""], "cancel", "job ids (strings)"),
        (["a", 3], "cancel", "job ids (strings)"),
        (["a"], "retry", "after_failure must be one of cancel, run"),
        ([str(i) for i in range(11)], "cancel", "at most 10 (JOBRELAY_MAX_DEPENDENCIES)"),
    ],
)
def test_what_cannot_be_written_says_why(after: object, failure: str, says: str) -> None:
    with pytest.raises(
        InvalidDependencies, match=r".*" + says.replace("(", r"\(").replace(")", r"\)")
    ):
        dependencies_of(after, failure, 10)  # type: ignore[arg-type]
