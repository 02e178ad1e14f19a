"""Group commit across concurrent intake requests: the one policy both stores' drivers run.

The rule, written once here and run by two small drivers in ``_server.py`` (SQLite: a
loop callback per group, its transaction inline; PostgreSQL: a task taking the groups
under the intake lock, each transaction on the database thread while the group before
it is folded):

1. Requests join groups in arrival order; a group holds at most ``MAX_GROUP`` of them
   (the next arrival starts the next group). Groups are taken oldest first. The
   SQLite driver takes the oldest group when it is :meth:`Groups.due`: it did not grow
   since the driver last looked (a lone request is taken at the first look), it holds
   ``ENOUGH_SPANS`` spans, a newer group has started, or it has been passed over
   ``GROWING_LOOKS`` times. Small requests that arrive together thus share one COMMIT
   instead of a COMMIT per loop turn (a batch is enough on its own); the
   PostgreSQL driver needs no such wait (its transaction on the database thread is
   the time in which the next group gathers).
2. A taken group's requests are screened in arrival order, each against the store plus
   what the members before it are storing (``Pending``: the runs they open, the bytes
   of the spans they take), as if each had committed before the next
   (:func:`screen_in_order`). A member whose screening fails gets its error; the others
   go on.
3. One COMMIT for the whole group.
4. :func:`settle`: if the COMMIT failed, every member gets its error and none is folded
   (503, retry: nothing of theirs was stored); otherwise each member is folded in
   arrival order, then answered (a screening or fold error answers that member alone).
   A 200 follows the COMMIT, never precedes it. A member whose sender went away is
   folded all the same (:func:`deliver` leaves its cancelled answer alone).

A request with no saga spans joins no group: the drivers answer it at once. Pure but
for :func:`deliver`, which sets an asyncio future.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from ._leases import Owner
from ._storage import HeartbeatRow, IntakeRows, SpanRow

M = TypeVar("M")
R = TypeVar("R")
T = TypeVar("T")

MAX_GROUP = 256
"""Requests per group commit (the next arrival starts the next group). Above the default
in-flight bound (64): a bound for a sidecar configured with more, not a batching delay."""
GROWING_LOOKS = 8
"""Looks for which a growing group may wait for more members (:meth:`Groups.due`): one
loop turn each on SQLite, bounding the wait of the group's first request."""
ENOUGH_SPANS = 512
"""A group of this many spans waits for no one (:meth:`Groups.due`): a COMMIT's fixed
cost is already shared, and bigger transactions measured slower per span (batch ingest
lost ~10% when 512-span requests waited for company)."""
GROUPS_IN_A_ROW = 4
"""PostgreSQL: groups taken per hold of the intake lock (eviction, sync and leases
get their turn between)."""


class Groups(Generic[M]):
    """Requests in arrival order, cut into groups of at most ``limit``, taken oldest first.

    Only the newest group takes new members; a group is closed once taken.
    """

    __slots__ = ("_looks", "_queue", "_seen", "_weight", "limit")

    def __init__(self, limit: int = MAX_GROUP) -> None:
        if limit < 1:
            raise ValueError(f"group limit {limit!r}: give at least 1 request per group")
        self.limit = limit
        self._queue: deque[list[M]] = deque()
        self._seen = 1  # the oldest group's size at the last look (1: as it started)
        self._looks = 0  # looks that passed the oldest group over
        self._weight = 0  # spans in the newest group

    def join(self, member: M, weight: int = 1) -> bool:
        """Add ``member`` (``weight``: its spans) to the newest group; True when it
        starts a new group (the driver then schedules that group's commit)."""
        queue = self._queue
        if queue and len(queue[-1]) < self.limit:
            queue[-1].append(member)
            self._weight += weight
            return False
        queue.append([member])
        self._weight = weight
        return True

    def due(self) -> bool:
        """Whether the oldest group should be taken now (False: look again after the
        next loop turn). It is due when it did not grow since the last look (or since
        it started, at the first), when it holds ``ENOUGH_SPANS`` spans, when it is
        full or a newer group has started (it cannot grow), or after ``GROWING_LOOKS``
        looks. A member that has just joined may have siblings whose bytes have arrived
        but whose handlers run a turn later: a group that grew waits one more turn for
        them. Raises IndexError when no group waits."""
        queue = self._queue
        size = len(queue[0])
        if (
            size > self._seen
            and len(queue) == 1
            and size < self.limit
            and self._weight < ENOUGH_SPANS
            and self._looks < GROWING_LOOKS
        ):
            self._seen = size
            self._looks += 1
            return False
        return True

    def take(self) -> list[M] | None:
        """The oldest group not taken yet (closed from here on), or None."""
        if not self._queue:
            return None
        self._seen, self._looks = 1, 0
        return self._queue.popleft()

    def __bool__(self) -> bool:
        """Whether some group waits to be taken."""
        return bool(self._queue)


@dataclass(slots=True)
class Pending:
    """What the members screened so far in a group store: as if they had committed."""

    owners: dict[str, Owner] = field(default_factory=dict)
    seen: dict[tuple[str, str], bytes] = field(default_factory=dict)

    def add(self, rows: IntakeRows) -> None:
        # The first stands: a later member cannot open a run or retake a span id that
        # an earlier one holds (screening refuses it, or finds the same bytes).
        for run_id, owner in rows.owners:
            self.owners.setdefault(run_id, owner)
        for row in rows.spans:
            self.seen.setdefault((row[0], row[1]), row[5])


class Screened(NamedTuple, Generic[R]):
    """One member screened: what it stores, and what its driver keeps for the fold."""

    rows: IntakeRows
    result: R


def screen_in_order(
    group: Sequence[M], screen: Callable[[M, Pending], Screened[R]]
) -> tuple[IntakeRows, list[R | Exception]]:
    """Screen each member in arrival order against the store (``screen`` reads it) plus
    ``Pending``: the members before it. The rows of the whole group (one COMMIT), and each
    member's result or the error its screening raised (that member alone fails)."""
    pending = Pending()
    spans: list[SpanRow] = []
    heartbeats: list[HeartbeatRow] = []
    owners: list[tuple[str, Owner]] = []
    outcomes: list[R | Exception] = []
    for member in group:
        try:
            screened = screen(member, pending)
        except Exception as exc:
            outcomes.append(exc)
            continue
        rows = screened.rows
        pending.add(rows)
        spans += rows.spans
        heartbeats += rows.heartbeats
        owners += rows.owners
        outcomes.append(screened.result)
    return IntakeRows(spans, heartbeats, owners), outcomes


def settle(
    group: Sequence[M],
    outcomes: Sequence[R | Exception] | Exception,
    fold: Callable[[M, R], T],
    answer: Callable[[M, T | Exception], None],
) -> None:
    """After the group's COMMIT. ``outcomes`` an error: the COMMIT (or what came before it)
    failed; every member gets that error and none is folded. Else each member's screening
    outcome, in arrival order: a member whose screening failed gets its error; the others
    are folded in arrival order, each answered with what its fold returned or the error
    it raised (that member alone)."""
    if isinstance(outcomes, Exception):
        for member in group:
            answer(member, outcomes)
        return
    if len(outcomes) != len(group):
        raise ValueError(f"{len(outcomes)} outcomes for a group of {len(group)}: give one each")
    for member, screened in zip(group, outcomes, strict=True):
        if isinstance(screened, Exception):
            answer(member, screened)
            continue
        try:
            folded: T | Exception = fold(member, screened)
        except Exception as exc:
            folded = exc
        answer(member, folded)


def deliver(future: asyncio.Future[T], outcome: T | Exception) -> None:
    """Answer a request's future; one whose sender went away (cancelled) stays so."""
    if future.done():
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
