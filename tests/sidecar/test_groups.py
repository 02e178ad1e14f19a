"""The group-commit policy (``sidecar/_groups.py``) on its own, over any arrival sequence.

A toy store and a toy screening rule with the real one's shape (a run belongs to the
instance whose span opened it; a span id taken again with the same bytes is a resend,
with other bytes refused) drive ``Groups``, ``screen_in_order`` and ``settle`` the way
both sidecar drivers do. Whatever the arrivals, the group bound and the failed COMMITs:
groups are consecutive slices of the arrivals, every request is answered once, a failed
group answers all its members with the failure and folds none, and the committed ones
get exactly what one request at a time (in arrival order, failed groups left out) gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar._groups import (
    ENOUGH_SPANS,
    GROWING_LOOKS,
    Groups,
    Pending,
    Screened,
    screen_in_order,
    settle,
)
from sidecar._leases import Owner
from sidecar._storage import IntakeRows

Span = tuple[str, str, bytes]  # run, span id, bytes


@dataclass(frozen=True)
class Request:
    number: int
    instance: str
    spans: tuple[Span, ...]


Taken = tuple[tuple[str, ...], tuple[str, ...]]  # (span ids stored, span ids refused)


@dataclass
class ToyStore:
    owners: dict[str, Owner] = field(default_factory=dict)
    spans: dict[tuple[str, str], bytes] = field(default_factory=dict)

    def screen(self, request: Request, pending: Pending) -> Screened[Taken]:
        if request.instance == "boom":
            raise ValueError(f"request {request.number}: screening failed")
        mine: dict[str, Owner] = {}
        rows = []
        kept, refused = [], []
        for run, span_id, data in request.spans:
            owner = mine.get(run) or pending.owners.get(run) or self.owners.get(run)
            if owner is None:
                owner = mine[run] = Owner(run, request.instance, "svc")
            prior = pending.seen.get((run, span_id), self.spans.get((run, span_id)))
            if owner.instance != request.instance or (prior is not None and prior != data):
                refused.append(span_id)
                continue
            kept.append(span_id)
            rows.append((run, span_id, 0.0, "svc", request.instance, data))
        return Screened(IntakeRows(rows, [], list(mine.items())), (tuple(kept), tuple(refused)))

    def commit(self, rows: IntakeRows) -> None:
        for run, owner in rows.owners:
            self.owners.setdefault(run, owner)
        for row in rows.spans:
            self.spans.setdefault((row[0], row[1]), row[5])


class Failed(Exception):
    pass


spans = st.tuples(st.sampled_from("ab"), st.sampled_from("xyz"), st.sampled_from([b"1", b"2"]))
requests = st.lists(
    st.tuples(st.sampled_from(["agent-1", "agent-2", "boom"]), st.lists(spans, max_size=3)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(
    arrivals=requests,
    takes=st.lists(st.booleans(), max_size=30),
    failures=st.lists(st.booleans(), max_size=12),
    limit=st.integers(1, 5),
)
def test_groups_commit_in_arrival_order_and_fail_whole(
    arrivals: list[tuple[str, list[Span]]], takes: list[bool], failures: list[bool], limit: int
) -> None:
    reqs = [Request(i, inst, tuple(s)) for i, (inst, s) in enumerate(arrivals)]
    store = ToyStore()
    groups: Groups[Request] = Groups(limit)
    taken_groups: list[list[Request]] = []
    failed: set[int] = set()
    folded: list[int] = []
    answers: dict[int, list[Taken | Exception]] = {r.number: [] for r in reqs}

    def fold(request: Request, taken: Taken) -> Taken:
        folded.append(request.number)
        return taken

    def answer(request: Request, outcome: Taken | Exception) -> None:
        answers[request.number].append(outcome)

    def commit_oldest() -> None:
        group = groups.take()
        if group is None:
            return
        taken_groups.append(group)
        rows, outcomes = screen_in_order(group, store.screen)
        fails = failures[len(taken_groups) - 1] if len(taken_groups) <= len(failures) else False
        if fails:  # the COMMIT fails: nothing of the group stored
            failed.update(r.number for r in group)
            settle(group, Failed("commit failed"), fold, answer)
            return
        store.commit(rows)
        settle(group, outcomes, fold, answer)

    # Arrivals interleaved with commits of the oldest group, as a loop would run them.
    pending_takes = iter(takes)
    for request in reqs:
        groups.join(request)
        if next(pending_takes, False):
            commit_oldest()
    while groups:
        commit_oldest()

    # Groups: consecutive slices of the arrivals, none over the bound, none empty.
    assert [r for g in taken_groups for r in g] == reqs
    assert all(1 <= len(g) <= limit for g in taken_groups)
    # Every request answered exactly once; folds in arrival order, never a failed one.
    assert all(len(a) == 1 for a in answers.values())
    assert folded == sorted(folded)
    assert not failed & set(folded)
    for number in failed:
        assert isinstance(answers[number][0], Failed)
    # Committed ones: what one request at a time gives (failed groups left out).
    alone = ToyStore()
    for request in reqs:
        if request.number in failed:
            continue
        try:
            screened = alone.screen(request, Pending())
        except ValueError as exc:
            expected: Taken | Exception = exc
        else:
            alone.commit(screened.rows)
            expected = screened.result
        got = answers[request.number][0]
        if isinstance(expected, Exception):
            assert isinstance(got, ValueError) and str(got) == str(expected)
            assert request.number not in folded
        else:
            assert got == expected
            assert request.number in folded
    assert store == alone


def test_a_new_group_starts_at_the_bound_and_only_the_newest_takes_members() -> None:
    groups: Groups[int] = Groups(2)
    assert [groups.join(n) for n in range(5)] == [True, False, True, False, True]
    assert groups.take() == [0, 1]
    assert groups.join(5) is False  # joins [4], the newest
    assert groups.take() == [2, 3]
    assert groups.take() == [4, 5]
    assert groups.take() is None and not groups
    assert groups.join(6) is True


def test_bad_bounds_and_mismatched_outcomes_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="group limit 0: give at least 1"):
        Groups(0)
    with pytest.raises(ValueError, match="1 outcomes for a group of 2"):
        settle([1, 2], [1], lambda m, r: r, lambda m, o: None)


def test_a_fold_error_answers_that_member_alone_and_the_rest_fold_on() -> None:
    got: list[tuple[int, object]] = []

    def fold(member: int, screened: int) -> int:
        if member == 1:
            raise RuntimeError("fold bug")
        return screened * 10

    settle([0, 1, 2], [0, 1, 2], fold, lambda m, o: got.append((m, o)))
    assert [m for m, _ in got] == [0, 1, 2]
    assert got[0] == (0, 0) and got[2] == (2, 20)
    assert isinstance(got[1][1], RuntimeError)


def test_a_lone_request_is_due_at_the_first_look() -> None:
    groups: Groups[int] = Groups()
    groups.join(0)
    assert groups.due()  # no wait for a request alone: the durable path's latency
    assert groups.take() == [0]


def test_a_growing_group_waits_until_a_look_finds_it_the_same_size() -> None:
    groups: Groups[int] = Groups()
    groups.join(0)
    groups.join(1)  # joined after the group started: more may be on the way
    assert not groups.due()
    groups.join(2)
    assert not groups.due()
    assert groups.due()  # a look with no arrival: take it
    assert groups.take() == [0, 1, 2]
    groups.join(3)
    assert groups.due()  # the next group starts counting afresh


def test_a_group_that_keeps_growing_waits_at_most_growing_looks() -> None:
    groups: Groups[int] = Groups()
    groups.join(0)
    passed = 0
    for n in range(1, 100):
        groups.join(n)
        if groups.due():
            break
        passed += 1
    assert passed == GROWING_LOOKS
    assert groups.take() == list(range(GROWING_LOOKS + 2))


def test_a_full_group_or_one_with_a_newer_group_behind_it_is_due() -> None:
    full: Groups[int] = Groups(3)
    for n in range(3):
        full.join(n)
    assert full.due()  # full: it cannot grow
    behind: Groups[int] = Groups(2)
    for n in range(3):
        behind.join(n)
    assert behind.due()  # [0, 1] is closed by [2]
    assert behind.take() == [0, 1]
    assert behind.due()  # [2] alone


def test_a_group_with_enough_spans_waits_for_no_one() -> None:
    groups: Groups[int] = Groups()
    groups.join(0, ENOUGH_SPANS - 1)
    groups.join(1, 1)  # grew, but now holds enough spans to share its COMMIT
    assert groups.due()
    assert groups.take() == [0, 1]
    groups.join(2, 1)
    groups.join(3, 1)  # the next group's weight starts afresh: small, growing
    assert not groups.due()
