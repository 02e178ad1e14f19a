"""The shared chaos checks in tests/support.py fail where they should."""

from __future__ import annotations

import pytest
from support import AlertReceiver, resent_cut_by_the_kill


def _pager(*received: tuple[str, float]) -> AlertReceiver:
    pager = AlertReceiver(start=False)
    pager.alerts.extend(
        {"dedup_key": key, "status": "firing", "_received": at} for key, at in received
    )
    return pager


def test_one_send_cut_by_the_kill_may_come_twice() -> None:
    pager = _pager(("a", 1.0), ("b", 2.0), ("a", 9.0))
    assert resent_cut_by_the_kill(pager, killed_by=5.0) == {("a", "firing"): 2}
    assert resent_cut_by_the_kill(_pager(("a", 1.0)), killed_by=5.0) == {}


@pytest.mark.parametrize(
    "received",
    [
        (("a", 6.0), ("a", 7.0)),  # first sent after the kill: not a cut send
        (("a", 1.0), ("a", 6.0), ("a", 7.0)),  # three times
        (("a", 1.0), ("a", 6.0), ("b", 1.0), ("b", 6.0)),  # two keys repeated
    ],
)
def test_any_other_repeat_fails(received: tuple[tuple[str, float], ...]) -> None:
    with pytest.raises(AssertionError):
        resent_cut_by_the_kill(_pager(*received), killed_by=5.0)
