"""The pure run-state machine: spans in, run views and status transitions out.

No I/O and no clock: every call that depends on time takes ``now``. The final
state of a run is a function of the *set* of its spans (plus the orphan mark and
a resolution), so spans may arrive in any order, more than once, and split
across requests: every rule below picks by span times and ids, never by arrival.

Memory matters (one sidecar watches every open run of a fleet), so a run keeps
compact named tuples, interned strings and raw JSON text, and builds its view
(``_views.RunView``) only when asked.
"""

from __future__ import annotations

import bisect
import heapq
import shlex
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, NamedTuple, TypeVar

from saga_otel import semconv as sc
from saga_otel.records import EscalationCard, is_pivot

from . import _jsontext as jsontext
from ._leases import Lease, Liveness, Override, Owner, lease_view
from ._otlp import SpanRecord
from ._storage import Resolution
from ._views import (
    END_STATUSES,
    AttemptView,
    CompensationView,
    EndStatus,
    EscalationView,
    PivotView,
    RunStatus,
    RunSummary,
    RunView,
    StepView,
)


class PendingComp(NamedTuple):
    """The undo a successful do pushed (args as the JSON text the span carried)."""

    tool: str
    args_text: str
    description: str


# Attempts sort by (attempt, start, span_id); the span id is unique within a step's
# list, so a comparison never reaches the later fields.
class DoAttempt(NamedTuple):
    attempt: int
    start: float
    span_id: int
    ok: bool
    error: str | None
    end: float
    comp: PendingComp | None
    unstorable: str | None  # why this do's undo could not be stored (then comp is None)


class CompAttempt(NamedTuple):
    attempt: int
    start: float
    span_id: int
    ok: bool
    error: str | None
    end: float
    tool: str | None


class RunSpan(NamedTuple):
    end: float
    span_id: int
    instance: str
    status: EndStatus
    failed_step: str | None


class Unwind(NamedTuple):
    start: float
    span_id: int
    reason: str | None
    failed_step: str | None


class Escalation(NamedTuple):
    start: float
    span_id: int
    reason: str
    card_text: str | None


class Revived(NamedTuple):
    """An orphaned run whose owner was heard from again (a late delivery, not a death)."""

    orphaned_at: float
    at: float


class Queue(NamedTuple):
    """A page of the review queue (``RunState.needing_person``)."""

    runs: list[RunSummary]  # oldest start first
    waiting: int  # runs that need a person, in all
    more: int  # of those, how many come after this page


class Drop(NamedTuple):
    """A marker span sent in place of a span the sidecar refused (``saga.export.dropped``)."""

    start: float
    span_id: int
    reason: str
    span: str  # the refused span's name ("" when the marker does not say)


NEEDS_PERSON = frozenset({sc.STATUS_COMPENSATION_FAILED, sc.STATUS_STUCK, sc.STATE_ORPHANED})
ALL_STATES: tuple[RunStatus, ...] = (
    sc.STATE_RUNNING,
    sc.STATE_UNWINDING,
    sc.STATUS_COMPLETED,
    sc.STATUS_COMPENSATED,
    sc.STATUS_COMPENSATION_FAILED,
    sc.STATUS_STUCK,
    sc.STATUS_REJECTED,
    sc.STATE_ORPHANED,
    sc.STATE_RECOVERED,
)
_RECOVERED_FROM = frozenset({sc.STATUS_COMPENSATED, sc.STATUS_COMPLETED})
_RECOVERED_FROM_OR_RECOVERED = frozenset({sc.STATUS_COMPENSATED, sc.STATE_RECOVERED})
# A run that finished forward (or never wrote) needs no page for an unstored undo.
_NO_ESCALATION = frozenset({sc.STATUS_COMPLETED, sc.STATUS_REJECTED})
_RECOVERED_FROM_OR_RECOVERED = frozenset({sc.STATUS_COMPENSATED, sc.STATE_RECOVERED})
# A run that finished forward (or never wrote) needs no page for an unstored undo.
_NO_ESCALATION = frozenset({sc.STATUS_COMPLETED, sc.STATUS_REJECTED})
_intern = sys.intern

# Heartbeat delivery (docs/semantic-conventions.md, "Orphaned"). An instance is dead when
# no heartbeat has arrived for its window: max(3 intervals, the delivery gap it has shown
# + 2 intervals). Until it has shown one, the gap is presumed to be an OpenTelemetry SDK's
# default batch delay; a learned gap is capped, so a dead agent is always noticed.
DEFAULT_BATCH_DELAY = 5.0  # BatchSpanProcessor's default schedule delay (every SDK)
MAX_DELIVERY_GAP = 30.0  # the OTLP exporters' default timeout: no cadence counts past it
_GAP_SAMPLES = 8  # the window follows the largest of the last few delivery gaps
# A live connection (saga_otel's presence stream) that closes without a goodbye means
# the process died, unless it reconnects or a heartbeat arrives within the grace.
PRESENCE_GRACE = 0.5
PRESENCE_SETTLE = 0.1  # a heartbeat this soon after the close was sent before it
# The orphan tick's queue of due moments may hold this many stale entries beyond two
# per instance before it is compacted (RunState._compact_dues).
_DUES_SLACK = 1024


@dataclass(frozen=True, slots=True)
class Transition:
    """A run's status changed (``before`` is None for a run seen the first time)."""

    run_id: str
    before: RunStatus | None
    after: RunStatus
    at: float
    # The person's resolution of the run that lapsed with this change (see _lapse): the
    # store clears that one only.
    lapsed: Resolution | None = None
    # The orphan mark (its orphaned_at) this change ended: the store clears that one.
    unmarked: float | None = None


@dataclass(frozen=True, slots=True)
class Applied:
    """What one batch of spans changed.

    With ``keep_before``, ``facts_changed`` lists the changed runs whose facts
    (``_facts``) moved, and :meth:`RunState.view_before` builds the view a run had
    before the batch.
    """

    changed: tuple[str, ...]
    transitions: tuple[Transition, ...]
    facts_changed: tuple[str, ...] = ()
    snapshots: Mapping[str, _Snapshot | None] = field(default_factory=dict)


class _Step:
    __slots__ = ("cls", "comps", "dos", "index", "name", "pivot_any", "pivot_ok")

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name
        self.cls: str | None = None
        self.pivot_any = False
        self.pivot_ok = False
        self.dos: tuple[DoAttempt, ...] = ()
        self.comps: tuple[CompAttempt, ...] = ()

    def copy(self) -> _Step:
        step = _Step(self.index, self.name)
        step.cls, step.pivot_any, step.pivot_ok = self.cls, self.pivot_any, self.pivot_ok
        step.dos, step.comps = self.dos, self.comps  # tuples: shared, never mutated
        return step

    def ok(self) -> bool:
        return any(a.ok for a in self.dos)

    def compensation(self) -> PendingComp | None:
        comp: PendingComp | None = None
        for a in self.dos:  # sorted: the last OK attempt that pushed wins
            if a.ok and a.comp is not None:
                comp = a.comp
        return comp

    def compensated(self) -> bool:
        return any(a.ok for a in self.comps)

    def unstorable(self) -> str | None:
        """Why an effect of this step may stand with no stored undo (the last such
        attempt's): a successful do whose undo could not be stored, or a do interrupted
        before it returned (its span failed); None once an OK compensate span says the
        effect was undone after all."""
        if self.compensated():
            return None
        reason: str | None = None
        for a in self.dos:
            if a.unstorable:
                reason = a.unstorable
        return reason


class _Run:
    __slots__ = (
        "comp_failing",
        "drops",
        "escalation",
        "first_comp_start",
        "instance",
        "instances",
        "last_change",
        "last_seen",
        "lease",
        "lowest_comp",
        "orig_key",
        "orphaned_at",
        "outlived",
        "owned",
        "owner_seen",
        "pivot",
        "resolution",
        "returned",
        "revived",
        "run_id",
        "run_spans",
        "saga",
        "service",
        "started_at",
        "status",
        "steps",
        "trace_id",
        "unstorable_at",
        "unwind",
        "updated_at",
    )

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.saga = ""
        self.service = ""
        self.instance = ""
        self.trace_id = ""
        self.orig_key: tuple[float, int] = (float("inf"), 0)
        self.instances: tuple[str, ...] = ()
        self.started_at = float("inf")
        self.updated_at = 0.0
        self.last_seen = 0.0
        self.steps: list[_Step] = []
        self.run_spans: tuple[RunSpan, ...] = ()
        self.unwind: Unwind | None = None
        self.first_comp_start: float | None = None
        self.escalation: Escalation | None = None
        self.orphaned_at: float | None = None
        # (orphaned_at, at): the owner was heard from again after the orphan mark.
        self.revived: Revived | None = None
        # Replicas: the change number (the store's order of writes, never a clock) of the
        # newest row of the run heard here, a span or its owner's heartbeat naming it (0:
        # none known, as on SQLite), and the orphan mark this replica heard the run after
        # (ended here, or read as stored before what it heard). See read_orphaned.
        self.last_change = 0
        self.outlived: float | None = None
        self.resolution: Resolution | None = None
        self.status: RunStatus = sc.STATE_RUNNING
        # Set from the stored owner: then no span may change trace, instance or service.
        self.owned = False
        self.owner_seen = 0.0  # the last span or heartbeat from the owner instance
        self.lease: Lease | None = None
        # The owner spoke about the run after a recovery lease was granted on it (the
        # latest such time): it came back, and the recoverer's renewals are refused.
        self.returned: float | None = None
        # Marker spans sent in place of spans the sidecar refused, in (start, span id) order.
        self.drops: tuple[Drop, ...] = ()
        # What the facts read of the steps, kept as steps change (``restep``), so a span
        # costs the same at step 3,000 as at step 3 (no walk over the steps per span):
        self.pivot: int | None = None  # the lowest index of a step that crossed a pivot
        self.unstorable_at: tuple[int, ...] = ()  # indexes whose step.unstorable() is set
        self.lowest_comp: int | None = None  # the lowest index of a step with compensations
        # Indexes of steps with compensations, none OK and at least one failed.
        self.comp_failing: tuple[int, ...] = ()

    def step(self, index: int, name: str) -> _Step:
        steps = self.steps
        # Steps mostly arrive in index order: look from the end, append at the end.
        # (A list, not a dict: a run's memory matters more than a scan of a few steps.)
        if not steps or steps[-1].index < index:
            step = _Step(index, name)
            steps.append(step)
            return step
        for step in reversed(steps):
            if step.index == index:
                return step
        step = _Step(index, name)
        bisect.insort(steps, step, key=_step_index)
        return step

    def shallow(self) -> _Run:
        """A copy of the run's own fields; ``steps`` is the live list (see _Snapshot)."""
        return _shallow(self)

    def restep(self, step: _Step) -> None:
        """Update what the facts read of the steps after ``step`` changed."""
        index = step.index
        if step.pivot_ok and (self.pivot is None or index < self.pivot):
            self.pivot = index
        self.unstorable_at = _mark(self.unstorable_at, index, step.unstorable() is not None)
        if step.comps:
            if self.lowest_comp is None or index < self.lowest_comp:
                self.lowest_comp = index
            failing = not step.compensated() and any(not a.ok for a in step.comps)
            self.comp_failing = _mark(self.comp_failing, index, failing)

    def recovering(self) -> bool:
        owner = self.instance
        for i in self.instances:  # noqa: SIM110 (a loop, not any(<genexpr>): per run per batch)
            if i != owner:
                return True
        return False

    def final_run_span(self) -> RunSpan | None:
        spans = sorted(self.run_spans)
        if not spans:
            return None
        if self.recovering():
            later = [r for r in spans if r.instance != self.instance]
            return later[-1] if later else None
        return spans[-1]

    def derive(self) -> RunStatus:
        status = self._derive()
        if status in _RECOVERED_FROM_OR_RECOVERED and self.effect_stands():
            # An effect with no stored undo (or a dropped span that may have held one)
            # stands: whatever the agent says, the run is not compensated.
            return sc.STATUS_COMPENSATION_FAILED
        return status

    def undo_stands(self) -> bool:
        """A pushed undo not yet done (the stack is not empty). Walks the steps: asked
        only once a recoverer has ended the run, not per span."""
        return any(s.compensation() is not None and not s.compensated() for s in self.steps)

    def effect_stands(self) -> bool:
        return bool(self.drops) or bool(self.unstorable_at)

    def owner_ended(self) -> bool:
        return any(r.instance == self.instance for r in self.run_spans)

    def _derive(self) -> RunStatus:
        final = self.final_run_span()
        if self.recovering() or len(self.run_spans) >= 2:
            if final is None:
                if self.orphaned_at is not None:
                    return sc.STATE_ORPHANED  # its recoverer went quiet, its lease ended
                # A second process took the run over and has not finished yet.
                others = self.lowest_comp is not None or self.unwind is not None
                return sc.STATE_UNWINDING if others else sc.STATE_RUNNING
            if final.status == sc.STATUS_COMPENSATED and self.undo_stands():
                # The recoverer says it undid all, but an undo is still on the stack (its
                # agent came back and pushed one after the recoverer read the stack):
                # an effect stands, and a person must know.
                return sc.STATUS_COMPENSATION_FAILED
            return sc.STATE_RECOVERED if final.status in _RECOVERED_FROM else final.status
        if final is not None:
            return final.status
        if self.orphaned_at is not None:
            return sc.STATE_ORPHANED
        if self.unwind is not None or self.first_comp_start is not None:
            return sc.STATE_UNWINDING
        return sc.STATE_RUNNING

    def has_ended(self) -> bool:
        return bool(self.run_spans)

    def needs_person(self) -> bool:
        """Stuck, compensation failed or orphaned, and no person has resolved it yet."""
        return self.status in NEEDS_PERSON and self.resolution is None


def _heard_under_lease(run: _Run, at: float) -> None:
    """The owner spoke about ``run`` at ``at``: past its lease's grant, the agent came back
    (``_leases.renew`` then stops the recoverer). Stored spans folded back at a start come
    before their leases are set, so a restart never makes a dead agent look back."""
    lease = run.lease
    if lease is not None and at > lease.granted_at and (run.returned or 0.0) < at:
        run.returned = at


def _unmark(run: _Run, at: float) -> float | None:
    """End the orphan mark of an open run heard from at ``at``: its owner spoke (late, not
    dead: kept as ``revived``) or a recoverer took it up (its agent is still dead; the run
    is watched for quiet again, see ``RunState._orphan``). The mark ended, or None. One
    rule for spans and heartbeats received here and read from other replicas."""
    mark = run.orphaned_at
    if mark is None or run.has_ended():
        return None
    if not run.recovering():
        run.revived = Revived(mark, at)
    run.orphaned_at = None
    run.outlived = mark  # read again from the store (its row re-stamped), it stays ended
    return mark


def _lapse(run: _Run) -> Resolution | None:
    """A run that comes to need a person (stuck, compensation failed, orphaned) after a
    person resolved it needs one again: what they resolved was an earlier situation (a
    run resolved while it unwound, then its undo failed; an orphan resolved, its agent
    back, then dead). The resolution goes, so the run's alerts fire and it is in the
    review queue. The one that went, if there was one."""
    lapsed = run.resolution
    run.resolution = None
    return lapsed


def _before_mark(resolved_at: float, orphaned_at: float | None) -> bool:
    """Whether a resolution made at ``resolved_at`` predates the run's orphan mark: a
    person resolved an earlier situation, so it lapses (``_lapse``); one made after the
    mark stands. The rule for marks and resolutions read from the store, whichever a
    replica folds first; at the same moment, the run is paged again rather than hidden."""
    return orphaned_at is not None and resolved_at <= orphaned_at


# How far after its orphan mark a resolution made at the mark's moment (or on a clock
# behind the marking replica's) is stamped: RunState.resolution_time.
RESOLVED_AFTER_MARK_S: Final = 0.001


def _mark_of(run: _Run) -> float | None:
    """The run's orphan mark, or the one it was revived from."""
    if run.orphaned_at is None and run.revived is not None:
        return run.revived.orphaned_at
    return run.orphaned_at


def _lapsed_by_mark(run: _Run, resolved_at: float) -> bool:
    """``_before_mark`` against the run's orphan mark, or the one it was revived from."""
    return _before_mark(resolved_at, _mark_of(run))


def _copier(cls: type[_Run]) -> Callable[[_Run], _Run]:
    """``cls``'s field-by-field copy as one straight-line function (a run is copied per
    batch it changes in: a loop of getattr/setattr over its slots cost three times as much)."""
    lines = [f"    run.{name} = self.{name}" for name in cls.__slots__]
    source = "def shallow(self):\n    run = new(cls)\n" + "\n".join(lines) + "\n    return run\n"
    scope: dict[str, object] = {"new": object.__new__, "cls": cls}
    exec(source, scope)  # a fixed template over the class's own slot names
    return scope["shallow"]  # type: ignore[return-value]


_shallow = _copier(_Run)


_Saved = dict[int, "_Step | None"]
"""id(step) -> the step as it was before this batch (None: the batch created it)."""


class _Snapshot(NamedTuple):
    """A run as it was before a batch, without copying its steps per span.

    ``run`` holds the run's own fields as they were; its steps are the live ones
    with those the batch changed put back from ``saved`` (and those it created left
    out): built only when a before view is asked for.
    """

    run: _Run
    live: _Run
    saved: _Saved

    def materialize(self) -> _Run:
        saved = self.saved
        steps = []
        for step in self.live.steps:
            before = saved.get(id(step), step)
            if before is not None:
                steps.append(before)
        self.run.steps = steps
        return self.run


def _step_index(step: _Step) -> int:
    return step.index


def _comp_failed(step: _Step, ended: bool, lowest_comp: int | None) -> bool:
    """A step's compensations all failed and the unwind moved on (or the run ended)."""
    return (
        bool(step.comps)
        and not step.compensated()
        and any(not a.ok for a in step.comps)
        and (ended or (lowest_comp is not None and lowest_comp < step.index))
    )


class Facts(NamedTuple):
    """What the alert rules read of a view. Equal facts mean equal alerts."""

    status: RunStatus
    unwind_started_at: float | None
    escalation: Escalation | None
    pivot_index: int | None
    failed: tuple[int, ...]
    resolved: bool
    # What a synthesized escalation card shows (see RunState._escalation).
    drops: int
    unstorable: tuple[int, ...]
    override: Override | None


def _facts(run: _Run) -> Facts:
    """O(failing steps), not O(steps): from the aggregates ``_Run.restep`` keeps."""
    failed: tuple[int, ...] = ()
    if run.comp_failing:  # what _comp_failed says of each step, from the aggregates
        ended = run.has_ended()
        lowest = run.lowest_comp
        failed = tuple(i for i in run.comp_failing if ended or (lowest is not None and lowest < i))
    return Facts(
        run.status,
        run.unwind.start if run.unwind else run.first_comp_start,
        run.escalation,
        run.pivot,
        failed,
        run.resolution is not None,
        len(run.drops),
        run.unstorable_at,
        run.lease.override if run.lease is not None else None,
    )


def _mark(indexes: tuple[int, ...], index: int, present: bool) -> tuple[int, ...]:
    """``indexes`` (sorted) with ``index`` in it or not."""
    if (index in indexes) == present:
        return indexes
    if present:
        return tuple(sorted((*indexes, index)))
    return tuple(i for i in indexes if i != index)


def _error_text(span: SpanRecord) -> str | None:
    if span.ok:
        return None
    for event in span.events:
        if event.name == "exception":
            kind = event.attributes.get("exception.type", "")
            message = event.attributes.get("exception.message", "")
            if kind or message:
                return f"{kind}: {message}" if kind else str(message)
    return span.status_message or "error"


def _parse_json(text: str | None) -> object:
    """The JSON text's value; {} when there is none or it is not JSON."""
    if text is None:
        return {}
    try:
        parsed: object = jsontext.loads(text)
    except ValueError:
        return {}
    return parsed


def _opt_str(value: object) -> str | None:
    return _intern(value) if isinstance(value, str) and value else None


_NEW_RUN_FACTS = _facts(_Run(""))


class RunState:
    """Every run the sidecar knows, and the instances that heart-beat.

    ``idle_timeout`` is how long a run of a process that sends no heartbeats may
    stay silent before it counts as orphaned.
    """

    def __init__(self, idle_timeout: float = 60.0) -> None:
        self.idle_timeout = idle_timeout
        self._runs: dict[str, _Run] = {}
        # Open runs (no run span, not orphaned), oldest activity first.
        self._idle: dict[str, None] = {}
        # Open runs that left the idle queue because their process heart-beats: the
        # heartbeat rule orphans them when that process dies.
        self._watched: dict[str, None] = {}
        # Open runs a recoverer is unwinding, gone quiet past the idle timeout while its
        # lease was live: judged again each tick, orphaned once the lease has ended.
        self._recovering: dict[str, None] = {}
        self._instances: dict[str, _Watch] = {}
        # (due, instance) of the live watches, soonest first: a tick looks only at those
        # past due, not at every instance (retention keeps many; most died long ago).
        # Stale entries (the watch moved on since) are dropped when they come up.
        self._dues: list[tuple[float, str]] = []

    # --- queries ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._runs)

    def instance_count(self) -> int:
        """Agent instances watched by heartbeats (forgotten after the retention)."""
        return len(self._instances)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._runs

    def run_ids(self) -> Iterator[str]:
        return iter(self._runs)

    def status(self, run_id: str) -> RunStatus | None:
        run = self._runs.get(run_id)
        return run.status if run else None

    def recovering(self, run_id: str) -> bool:
        """Whether a process other than its owner (a recoverer) has written to the run."""
        run = self._runs.get(run_id)
        return run is not None and run.recovering()

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = dict.fromkeys(ALL_STATES, 0)
        for run in self._runs.values():
            counts[run.status] = counts.get(run.status, 0) + 1
        return counts

    def labels(self, run_id: str) -> tuple[str, str]:
        """The run's (saga, service): the labels of the metrics derived from the stream."""
        run = self._runs.get(run_id)
        return (run.saga, run.service) if run else ("", "")

    def in_progress(self) -> dict[tuple[str, str], int]:
        """Open runs (running or unwinding) by (saga, service)."""
        out: dict[tuple[str, str], int] = {}
        for run in self._runs.values():
            if run.status == sc.STATE_RUNNING or run.status == sc.STATE_UNWINDING:
                key = (run.saga, run.service)
                out[key] = out.get(key, 0) + 1
        return out

    def unwind_duration(self, run_id: str) -> float | None:
        """From the unwind's start to the run's end, for an ended run that unwound."""
        run = self._runs.get(run_id)
        if run is None:
            return None
        final = run.final_run_span()
        start = run.unwind.start if run.unwind else run.first_comp_start
        if final is None or start is None:
            return None
        return max(0.0, final.end - start)

    def failed_compensations(self, run_id: str) -> list[str]:
        """Steps whose effect stands: every compensation failed, or no undo was stored."""
        run = self._runs.get(run_id)
        if run is None:
            return []
        ended = run.has_ended()
        lowest = min((s.index for s in run.steps if s.comps), default=None)
        return [
            s.name
            for s in run.steps
            if _comp_failed(s, ended, lowest) or s.unstorable() is not None
        ]

    def orphaned_unresolved(self) -> int:
        return sum(
            1 for r in self._runs.values() if r.status == sc.STATE_ORPHANED and r.resolution is None
        )

    def summaries(
        self,
        *,
        status: str | None = None,
        saga: str | None = None,
        since: float | None = None,
        until: float | None = None,
        needs_person: bool = False,
        id_prefix: str | None = None,
    ) -> list[RunSummary]:
        """Matching runs, newest start first (ties by run id, descending)."""
        out = []
        for run in self._runs.values():
            if id_prefix is not None and not run.run_id.startswith(id_prefix):
                continue
            if status is not None and run.status != status:
                continue
            if saga is not None and run.saga != saga:
                continue
            if since is not None and run.started_at < since:
                continue
            if until is not None and run.started_at > until:
                continue
            if needs_person and not run.needs_person():
                continue
            out.append(self._summary(run))
        out.sort(key=_summary_key, reverse=True)
        return out

    def needing_person(self, limit: int, after: tuple[float, str] | None = None) -> Queue:
        """The review queue: of the runs that need a person, the ``limit`` that started
        first (ties by run id, an unknown start last) after the key ``after`` (a page's
        last ``(started_at or inf, run_id)``). One pass over the runs in memory, and a
        summary for the page's runs only (all of them took ~2 s for 30,000 orphans)."""
        waiting = [run for run in self._runs.values() if run.needs_person()]
        later = waiting if after is None else [r for r in waiting if _start_key(r) > after]
        page = heapq.nsmallest(limit, later, key=_start_key)
        return Queue([self._summary(r) for r in page], len(waiting), len(later) - len(page))

    def last_step(self, run_id: str) -> str | None:
        """The name of the run's highest step (where an orphan's agent went silent)."""
        run = self._runs.get(run_id)
        if run is None or not run.steps:
            return None
        return max(run.steps, key=lambda s: s.index).name

    def _summary(self, run: _Run) -> RunSummary:
        final = run.final_run_span()
        return {
            "run_id": run.run_id,
            "saga": run.saga,
            "service": run.service,
            "instance": run.instance,
            "status": run.status,
            "started_at": _finite(run.started_at),
            "updated_at": run.updated_at,
            "ended_at": final.end if final else None,
            "failed_step": self._failed_step(run),
            "stack_depth": len(self._stack(run)),
            "resolved": run.resolution is not None,
        }

    def view(self, run_id: str) -> RunView | None:
        """The run view of docs/internals.md, or None for an unknown run."""
        run = self._runs.get(run_id)
        return None if run is None else self._view(run)

    def view_before(self, applied: Applied, run_id: str) -> RunView | None:
        """The view ``run_id`` had before ``applied`` (which must be ``keep_before``)."""
        snapshot = applied.snapshots.get(run_id)
        return None if snapshot is None else self._view(snapshot.materialize())

    def _view(self, run: _Run) -> RunView:
        final = run.final_run_span()
        ended = run.has_ended()
        lowest_comp = min((s.index for s in run.steps if s.comps), default=None)
        steps: list[StepView] = []
        pivot: PivotView | None = None
        for s in run.steps:
            comp = s.compensation()
            compensated = s.compensated()
            failed = _comp_failed(s, ended, lowest_comp)
            if pivot is None and s.pivot_ok:
                pivot = {"step": s.name, "index": s.index}
            steps.append(
                {
                    "index": s.index,
                    "name": s.name,
                    "class": s.cls,
                    "pivot": s.pivot_any,
                    "ok": s.ok(),
                    "attempts": [_attempt_dict(a) for a in s.dos],
                    "compensation": _comp_dict(s, comp) if comp else None,
                    "compensations": [_attempt_dict(a) for a in s.comps],
                    "compensated": compensated,
                    "compensation_failed": failed,
                    "compensation_unstorable": s.unstorable(),
                }
            )
        escalation: EscalationView | None = None
        if run.escalation is not None:
            escalation = {
                "reason": run.escalation.reason,
                "card": _parse_json(run.escalation.card_text),
            }
        elif run.effect_stands() and run.status not in _NO_ESCALATION:
            escalation = self._escalation(run, steps)
        lease = run.lease
        return {
            "run_id": run.run_id,
            "saga": run.saga,
            "service": run.service,
            "instance": run.instance,
            "trace_id": run.trace_id,
            "status": run.status,
            "started_at": _finite(run.started_at),
            "updated_at": run.updated_at,
            "ended_at": final.end if final else None,
            "failed_step": self._failed_step(run),
            "unwind_reason": run.unwind.reason if run.unwind else None,
            "unwind_started_at": run.unwind.start if run.unwind else run.first_comp_start,
            "pivot": pivot,
            "steps": steps,
            "stack": self._stack(run),
            "escalation": escalation,
            "resolution": (
                {"note": run.resolution.note, "at": run.resolution.at, "by": run.resolution.by}
                if run.resolution
                else None
            ),
            "dropped_spans": [
                {"span": d.span, "reason": d.reason, "at": d.start, "span_id": f"{d.span_id:016x}"}
                for d in run.drops
            ],
            "recovery": lease_view(lease) if lease is not None else None,
            "revived": (
                {"orphaned_at": run.revived.orphaned_at, "at": run.revived.at}
                if run.revived
                else None
            ),
        }

    def _escalation(self, run: _Run, steps: list[StepView]) -> EscalationView:
        """The card for an effect that stands unseen by the agent's own card: an undo that
        could not be stored, or a span refused as too large (and so missing here)."""
        not_undone = [
            f"{s['name']} (step #{s['index']}, tool {s['name']}): its undo could not be "
            f"stored: {s['compensation_unstorable']}"
            for s in steps
            if s["compensation_unstorable"]
        ]
        not_undone += [
            f"a span ({d.span or 'unnamed'}) was refused by the sidecar ({d.reason}): what it "
            "recorded, perhaps an undo, is missing from this run"
            for d in run.drops
        ]
        card = EscalationCard(
            saga=run.saga,
            run_id=run.run_id,
            reason=sc.ESCALATION_COMPENSATION_FAILED,
            failed_step=self._failed_step(run),
            error=run.unwind.reason if run.unwind else None,
            done=tuple(f"{s['name']} ({s['class']})" for s in steps if s["ok"]),
            undone=tuple(
                f"{s['name']} (tool {s['compensation']['tool'] if s['compensation'] else '?'})"
                for s in steps
                if s["compensated"]
            ),
            not_undone=tuple(not_undone),
            irreversible=tuple(s["name"] for s in steps if s["ok"] and s["pivot"]),
            decide=(
                "Undo these effects by hand (the sidecar holds no undo for them), then "
                # shlex, not repr: a person pastes this, and a run id may hold $( ) and quotes.
                f"`saga-sidecar runs resolve {shlex.quote(run.run_id)} --note ...`",
            ),
        ).to_dict()
        override = run.lease.override if run.lease is not None else None
        if override is not None:
            card["recovery_override"] = {"reason": override.reason, "by": override.by}
        return {"reason": sc.ESCALATION_COMPENSATION_FAILED, "card": card}

    def stack(self, run_id: str) -> list[CompensationView] | None:
        run = self._runs.get(run_id)
        return None if run is None else self._stack(run)

    @staticmethod
    def _stack(run: _Run) -> list[CompensationView]:
        items = []
        for s in reversed(run.steps):  # top of stack = highest index
            comp = s.compensation()
            if comp is not None and not s.compensated():
                items.append(_comp_dict(s, comp))
        return items

    @staticmethod
    def _failed_step(run: _Run) -> str | None:
        final = run.final_run_span()
        if final is not None and final.failed_step:
            return final.failed_step
        if run.unwind is not None and run.unwind.failed_step:
            return run.unwind.failed_step
        for r in sorted(run.run_spans, reverse=True):
            if r.failed_step:
                return r.failed_step
        return None

    # --- changes ---------------------------------------------------------------

    def apply(
        self,
        spans: Iterable[SpanRecord],
        now: float,
        *,
        keep_before: bool = False,
        owners: Mapping[str, Owner] | None = None,
        change: int | Mapping[str, int] = 0,
    ) -> Applied:
        """Fold validated spans (see ``saga_otel.contract``) into the state.

        ``owners`` fixes the owner of runs this batch opens (the intake decided it).

        ``change``: the change number the store gave these rows (replicas: the id of the
        transaction that wrote them): one for a batch this process stored, or per run for
        rows other replicas stored; 0 when there is none (SQLite). ``read_orphaned``
        orders orphan marks against it.

        ``keep_before`` keeps cheap copies of the changed runs, so a caller builds
        the before views (:meth:`view_before`) only of the runs whose facts changed.
        """
        changed: dict[str, None] = {}
        touched: dict[str, _Run] = {}
        before_status: dict[str, RunStatus | None] = {}
        snapshots: dict[str, _Snapshot | None] = {}
        before_facts: dict[str, Facts] = {}
        runs = self._runs
        fold = self._fold
        beats: dict[str, list[SpanRecord]] = {}
        heard: set[str] = set()  # runs whose owner spoke in this batch
        per_run = change if isinstance(change, Mapping) else None
        batch_change = 0 if isinstance(change, Mapping) else change

        def touch(run_id: str) -> _Run:
            found = runs.get(run_id)
            before_status[run_id] = found.status if found else None
            if keep_before:
                snapshots[run_id] = _Snapshot(found.shallow(), found, {}) if found else None
                before_facts[run_id] = _facts(found) if found else _NEW_RUN_FACTS
            if found is None:
                found = runs[run_id] = _Run(_intern(run_id))
                owner = owners.get(run_id) if owners else None
                if owner is not None:
                    self.set_owner(run_id, owner)
            touched[run_id] = found
            return found

        for span in spans:
            attrs = span.attributes
            phase = attrs.get(sc.SAGA_PHASE)
            if phase == sc.PHASE_HEARTBEAT:
                beats.setdefault(_intern(span.instance), []).append(span)
                continue
            run_id = attrs.get(sc.SAGA_RUN_ID)
            if not isinstance(run_id, str) or not run_id:
                continue  # validation rejects these; never trust it blindly
            run = touched.get(run_id)
            if run is None:  # first span of this run in the batch
                run = touch(run_id)
            snap = snapshots.get(run_id) if keep_before else None
            if fold(run, span, phase, snap.saved if snap is not None else None):
                changed[run_id] = None
            if run.instance == span.instance:
                heard.add(run_id)
                if now > run.owner_seen:
                    run.owner_seen = now
        # After the runs' own spans: a heartbeat may name a run this batch opened.
        for instance, group in beats.items():
            for run_id in self._heartbeats(instance, group, now, batch_change):
                if run_id not in touched:
                    touch(run_id)
                heard.add(run_id)
        unmarked: dict[str, float] = {}  # the orphan marks ended, by run
        for run_id in heard:
            run = touched[run_id]
            if run.lease is not None:
                _heard_under_lease(run, now)
            if run.orphaned_at is not None and not run.recovering():
                mark = _unmark(run, now)  # heard from again: it was late, not dead
                if mark is not None:
                    unmarked[run_id] = mark
                    changed[run_id] = None
        idle = self._idle
        # Once per run, not per span: every run of the batch was seen at ``now``, so
        # their order among themselves in the idle queue does not matter.
        for run_id, run in touched.items():
            if run_id in changed:
                if run.orphaned_at is not None and run.recovering():
                    mark = _unmark(run, now)  # a recoverer took it up
                    if mark is not None:
                        unmarked[run_id] = mark
                run.status = run.derive()
            if now > run.last_seen:
                run.last_seen = now
            number = batch_change if per_run is None else per_run.get(run_id, 0)
            if number > run.last_change:
                run.last_change = number
            idle.pop(run_id, None)
            self._watched.pop(run_id, None)
            self._recovering.pop(run_id, None)
            if not run.has_ended() and run.orphaned_at is None:
                idle[run_id] = None
        transitions = []
        for run_id in changed:
            run = runs[run_id]
            status = run.status
            before = before_status[run_id]
            if status != before:
                lapsed = _lapse(run) if status in NEEDS_PERSON else None
                # An orphaned run that ended keeps its mark in memory (its status is its
                # end's); the store's goes all the same.
                mark = None
                if before == sc.STATE_ORPHANED:
                    mark = unmarked.get(run_id, run.orphaned_at)
                transitions.append(Transition(run_id, before, status, now, lapsed, mark))
        facts_changed: tuple[str, ...] = ()
        if keep_before:
            facts_changed = tuple(r for r in changed if _facts(runs[r]) != before_facts[r])
        return Applied(
            tuple(changed),
            tuple(transitions),
            facts_changed,
            {k: snapshots[k] for k in changed} if keep_before else {},
        )

    def _heartbeats(
        self, instance: str, beats: list[SpanRecord], now: float, change: int
    ) -> list[str]:
        """One delivery's heartbeats of one instance (stored with change number
        ``change``); the owned runs they name (in order).

        Learns the instance's delivery cadence: the receipt gap since its previous
        delivery is a sample when the agent beat without a break in between (this
        delivery's first beat follows the last one seen within 1.5 intervals, by the
        spans' own times), so a pause with no open runs teaches nothing. A first beat
        before the last one seen is no such follow-up: the agent's clock was stepped back
        (NTP), and the pause before it is as unknown as any other; the beats are then
        measured from the new clock's.
        """
        last_span = max(beats, key=_span_end)
        interval = float(last_span.attributes.get(sc.SAGA_HEARTBEAT_INTERVAL_S, 1.0))
        first, last = min(b.end for b in beats), last_span.end
        watch = self._instances.get(instance)
        if watch is None:
            watch = self._instances[instance] = _Watch(now, interval)
        elif now > watch.at:
            continuous = watch.beat is not None and 0 <= first - watch.beat <= 1.5 * interval
            if continuous:
                watch.learn(now - watch.at)
            watch.beating(now)
        watch.interval = interval
        if last > first:  # beats that waited together: the batch spans this much
            watch.learn(last - first + interval)
        watch.beat = last  # the agent's clock, as it now runs
        self._schedule(instance, watch)
        named: dict[str, None] = {}
        for span in beats:
            for run_id in span.attributes.get(sc.SAGA_HEARTBEAT_OPEN_RUNS, ()):
                run = self._owner_heard(instance, run_id, now, change)
                if run is not None and run.orphaned_at is not None:
                    named[run_id] = None
        return list(named)

    def _owner_heard(self, instance: str, run_id: str, at: float, change: int) -> _Run | None:
        """A heartbeat of ``instance`` named ``run_id``, heard at ``at`` (stored with change
        number ``change``): the run, if it is kept alive by it (else None).

        Only the owner's heartbeat keeps a run alive: a stranger naming it must not hold
        off its orphan watch (a recoverer is watched through its lease)."""
        run = self._runs.get(run_id)
        if run is None or run.instance != instance:
            return None
        run.last_seen = max(run.last_seen, at)
        run.owner_seen = max(run.owner_seen, at)
        if change > run.last_change:
            run.last_change = change
        if run.lease is not None:
            _heard_under_lease(run, at)
        if run_id in self._idle:  # still alive: to the young end of the queue
            del self._idle[run_id]
            self._idle[run_id] = None
        return run

    def _beat(
        self,
        instance: str,
        at: float,
        interval: float,
        open_runs: Iterable[str],
        now: float,
        change: int,
    ) -> list[Transition]:
        """A heartbeat another replica stored at ``at`` (with change number ``change``) and
        this one read at ``now`` (``heard``): the watch moves on, what it learned of the
        instance's cadence stays.
        It counts as heard when read, never at ``at``: the other replica's COMMIT may have
        waited (a lock, a slow disk) while the agent waited for its answer, and silence we
        caused is not the agent's; and ``at`` is the other replica's clock, which may run
        ahead of ours (a dead agent was kept alive for the size of the skew). A lost
        connection is still judged against ``at``, when the agent spoke, but never later
        than now."""
        watch = self._instances.get(instance)
        if watch is None:
            watch = self._instances[instance] = _Watch(now, interval)
        else:
            watch.interval = interval
            watch.beating(min(at, now), now)
        self._schedule(instance, watch)
        transitions = []
        for run_id in open_runs:
            run = self._owner_heard(instance, run_id, now, change)
            if run is not None and run.orphaned_at is not None and not run.recovering():
                revived = self._unmarked(run, now)  # as a heartbeat received here
                if revived is not None:
                    transitions.append(revived)
        return transitions

    def _unmarked(self, run: _Run, at: float) -> Transition | None:
        """End the run's orphan mark (``_unmark``) outside a batch of spans: its status and
        idle queue follow; the transition, or None when there was no mark to end."""
        before = run.status
        mark = _unmark(run, at)
        if mark is None:
            return None
        run_id = run.run_id
        run.status = run.derive()
        self._idle.pop(run_id, None)
        self._watched.pop(run_id, None)
        self._recovering.pop(run_id, None)
        self._idle[run_id] = None  # open, not orphaned: watched for quiet from now
        return Transition(run_id, before, run.status, at, unmarked=mark)

    def _fold(
        self, run: _Run, span: SpanRecord, phase: object, saved: _Saved | None = None
    ) -> bool:
        """Fold one span; False when it was a duplicate that changed nothing.

        With ``saved``, a step about to change is first saved there (see _Snapshot).
        """
        attrs = span.attributes
        span_id = int(span.span_id or "0", 16)
        changed = False
        key = (span.start, span_id)
        instance = _intern(span.instance)
        if key < run.orig_key and not run.owned:
            run.orig_key = key
            run.instance = instance
            run.trace_id = _intern(span.trace_id)
            run.service = _intern(span.service) if span.service else run.service
            saga = attrs.get(sc.SAGA_NAME)
            if isinstance(saga, str) and saga:
                run.saga = _intern(saga)
            changed = True
        elif not run.saga and isinstance(attrs.get(sc.SAGA_NAME), str):
            run.saga = _intern(attrs[sc.SAGA_NAME])
        if instance not in run.instances:
            run.instances = (*run.instances, instance)
            changed = True
        if span.start < run.started_at:
            run.started_at = span.start
            changed = True
        latest = max(span.end, span.start)
        if latest > run.updated_at:
            run.updated_at = latest
            changed = True

        dropped = attrs.get(sc.SAGA_EXPORT_DROPPED)
        if dropped is not None:
            # A marker in place of a span the sidecar refused (too large): shown on the
            # run, never folded as the phase it names.
            if any(d.span_id == span_id for d in run.drops):
                return changed
            name = attrs.get(sc.SAGA_EXPORT_DROPPED_SPAN)
            drop = Drop(span.start, span_id, str(dropped), name if isinstance(name, str) else "")
            run.drops = tuple(sorted((*run.drops, drop)))
            return True
        if phase == sc.PHASE_DO or phase == sc.PHASE_COMPENSATE:
            index = int(attrs[sc.SAGA_STEP_INDEX])
            name = attrs.get(sc.SAGA_STEP_NAME)
            count = len(run.steps)
            step = run.step(index, _intern(name) if isinstance(name, str) else "")
            if saved is not None and id(step) not in saved:
                saved[id(step)] = step.copy() if len(run.steps) == count else None
            attempt = int(attrs.get(sc.SAGA_STEP_ATTEMPT, 1))
            ok = span.ok
            error = None if ok else _error_text(span)
            if phase == sc.PHASE_DO:
                dos = step.dos
                for a in dos:
                    if a.span_id == span_id:
                        return changed
                if isinstance(name, str):
                    step.name = _intern(name)
                cls = attrs.get(sc.SAGA_STEP_CLASS)
                if isinstance(cls, str):
                    step.cls = _intern(cls)
                pivot = is_pivot(cls, attrs.get(sc.SAGA_STEP_PIVOT) is True)
                step.pivot_any = step.pivot_any or pivot
                step.pivot_ok = step.pivot_ok or (pivot and ok)
                tool = attrs.get(sc.SAGA_COMPENSATION_TOOL)
                comp = None
                if ok and isinstance(tool, str) and tool:
                    comp = PendingComp(
                        _intern(tool),
                        attrs.get(sc.SAGA_COMPENSATION_ARGS) or "{}",
                        attrs.get(sc.SAGA_COMPENSATION_DESCRIPTION) or "",
                    )
                unstorable = attrs.get(sc.SAGA_COMPENSATION_UNSTORABLE)
                entry = DoAttempt(
                    attempt,
                    span.start,
                    span_id,
                    ok,
                    error,
                    span.end,
                    comp,
                    str(unstorable) if unstorable else None,
                )
                step.dos = _insert(dos, entry)
                if unstorable or (pivot and ok):
                    # Only these move what the facts read of a step (an attempt without
                    # an unstorable reason never changes step.unstorable()).
                    run.restep(step)
            else:
                comps = step.comps
                for c in comps:
                    if c.span_id == span_id:
                        return changed
                if not step.dos and isinstance(name, str) and not step.name:
                    step.name = _intern(name)
                tool = attrs.get(sc.SAGA_COMPENSATION_TOOL)
                entry_c = CompAttempt(
                    attempt,
                    span.start,
                    span_id,
                    ok,
                    error,
                    span.end,
                    _intern(tool) if isinstance(tool, str) else None,
                )
                step.comps = _insert(comps, entry_c)
                run.restep(step)
                if run.first_comp_start is None or span.start < run.first_comp_start:
                    run.first_comp_start = span.start
            return True
        if phase == sc.PHASE_RUN:
            if any(r.span_id == span_id for r in run.run_spans):
                return changed
            entry_run = RunSpan(
                span.end,
                span_id,
                instance,
                END_STATUSES[attrs[sc.SAGA_RUN_STATUS]],  # validated at intake
                _opt_str(attrs.get(sc.SAGA_RUN_FAILED_STEP)),
            )
            run.run_spans = tuple(sorted((*run.run_spans, entry_run)))
            return True
        if phase == sc.PHASE_UNWIND:
            unwind = Unwind(
                span.start,
                span_id,
                attrs.get(sc.SAGA_UNWIND_REASON),
                _opt_str(attrs.get(sc.SAGA_RUN_FAILED_STEP)),
            )
            if run.unwind is None or unwind[:2] < run.unwind[:2]:
                run.unwind = unwind
                return True
            return changed
        if phase == sc.PHASE_ESCALATE:
            escalation = Escalation(
                span.start,
                span_id,
                str(attrs.get(sc.SAGA_ESCALATION_REASON, "")),
                attrs.get(sc.SAGA_ESCALATION_CARD),
            )
            if run.escalation is None or escalation[:2] > run.escalation[:2]:
                run.escalation = escalation
                return True
            return changed
        return changed  # validate: identity only

    def tick(self, now: float) -> list[Transition]:
        """Orphan the runs whose process went quiet. Call it often; cost is per change."""
        transitions: list[Transition] = []
        dead: set[str] = set()
        dues = self._dues
        while dues and dues[0][0] < now:
            _, instance = heapq.heappop(dues)
            hb = self._instances.get(instance)
            if hb is None or hb.dead or hb.scheduled >= now:
                continue  # forgotten, already dead, or moved on (its newer due is queued)
            if hb.dead_at(now):
                # Nothing is queued for it now: if it is heard from again, even with the
                # same due (a lost connection's grace), _schedule must queue that again.
                hb.dead, hb.scheduled = True, float("inf")
                dead.add(instance)
            else:  # a change no _schedule saw: queue what is due now (never lose a watch)
                self._schedule(instance, hb)
        if dead:  # rare: one scan of the open runs per process death
            runs = self._runs
            open_runs = [*self._idle, *self._watched]
            for run_id in [r for r in open_runs if runs[r].instance in dead]:
                transitions.extend(self._orphan(run_id, now))
        while self._idle:
            run_id = next(iter(self._idle))
            run = self._runs[run_id]
            if now - run.last_seen <= self.idle_timeout:
                break
            watch = self._instances.get(run.instance)
            if watch is not None and not watch.dead:
                # Watched by heartbeats instead: leave the idle queue; the heartbeat rule
                # above finds it when its process dies.
                del self._idle[run_id]
                self._watched[run_id] = None
                continue
            transitions.extend(self._orphan(run_id, now))
        for run_id in list(self._recovering):  # few: runs recovered right now
            transitions.extend(self._orphan(run_id, now))
        return transitions

    def _orphan(self, run_id: str, now: float) -> list[Transition]:
        self._idle.pop(run_id, None)
        self._watched.pop(run_id, None)
        self._recovering.pop(run_id, None)
        run = self._runs[run_id]
        if run.has_ended() or run.orphaned_at is not None:
            return []
        if run.recovering():
            # A recoverer holds it: quiet is fine while its lease lives (a long undo).
            # Once the lease has ended (a recoverer dead, or gone without finishing) the
            # run is orphaned again and pages: nobody is unwinding it.
            lease = run.lease
            if lease is not None and lease.live(now):
                self._recovering[run_id] = None
                return []
        before = run.status
        run.orphaned_at = now
        run.status = run.derive()
        if run.status == before:
            return []
        return [Transition(run_id, before, run.status, now, _lapse(run))]

    def restore_orphaned(self, run_id: str, at: float) -> Transition | None:
        """Apply an orphan mark read from the store (this sidecar's before a restart, or
        another replica's); the transition when it moved the run's status, None when the
        run is unknown, ended or orphaned already."""
        run = self._runs.get(run_id)
        if run is None or run.has_ended() or run.orphaned_at is not None:
            return None
        before = run.status
        run.orphaned_at = at
        run.status = run.derive()
        self._idle.pop(run_id, None)
        self._watched.pop(run_id, None)
        self._recovering.pop(run_id, None)
        if run.status == before:
            return None
        resolution = run.resolution
        lapsed = _lapse(run) if resolution is not None and _before_mark(resolution.at, at) else None
        return Transition(run_id, before, run.status, at, lapsed)

    def marked(self, marks: Iterable[tuple[str, float]]) -> list[tuple[str, float]]:
        """Of ``marks`` (run id, orphan mark), those still their runs' marks: a run heard
        from since, taken up by a recoverer or forgotten has none, or a later one."""
        runs = self._runs
        return [
            (run_id, at)
            for run_id, at in marks
            if (run := runs.get(run_id)) is not None and run.orphaned_at == at
        ]

    def read_orphaned(self, run_id: str, at: float, change: int) -> Transition | None:
        """An orphan mark another replica stored (``restore_orphaned``) in a row of change
        number ``change``, unless this replica heard from the run after it: a span of the
        run (its owner's or a recoverer's) or its owner's heartbeat naming it, stored with
        a later change number (the leader judged before it read that, and ends the mark
        once it does); nor when this very mark ended here already (its row comes again
        when a resolution changes it).

        Change numbers, not times: the mark holds the leader's clock and what this
        replica heard its own, so a clock ahead of the leader's would drop every mark (a
        dead run left running here) and one behind would take a mark its agent outlived.
        """
        run = self._runs.get(run_id)
        if run is None or run.outlived == at:
            return None
        if run.last_change > change:
            run.outlived = at  # read again, it is still older than what was heard here
            return None
        return self.restore_orphaned(run_id, at)

    def read_unmarked(self, run_id: str, mark: float, now: float) -> Transition | None:
        """Another replica ended the orphan mark ``mark`` (it heard from the run): end it
        here too, if the run still has that one (a later orphaning stands)."""
        run = self._runs.get(run_id)
        if run is None or run.orphaned_at != mark:
            return None
        return self._unmarked(run, now)

    def presence_opened(self, instance: str) -> None:
        """The instance (re)opened its live connection: any loss is forgotten."""
        watch = self._instances.get(instance)
        if watch is not None:
            watch.lost_at = None
            self._schedule(instance, watch)

    def presence_lost(self, instance: str, now: float) -> None:
        """The instance's last live connection closed without a goodbye: its process has
        likely died. ``tick`` confirms (no reconnect, no heartbeat) after PRESENCE_GRACE."""
        watch = self._instances.get(instance)
        if watch is not None and not watch.dead:
            watch.lost_at = now
            self._schedule(instance, watch)

    def clock_stepped(self, step: float) -> None:
        """The sidecar's clock was stepped by ``step`` seconds (NTP, a VM resumed) while no
        time passed: every receipt time kept here moves with it, so each silence stays what
        it was (a step forward orphans no live agent, a step back spares no dead one) and
        later receipts, on the new clock, compare with them. Receipt times move (the
        instances' last delivery and lost connection, the runs' last activity and last
        word from their owner, the queue of due moments), and so do the recovery leases
        and the owner's return under one, so a lease's remaining time stays what it was
        (the store moves its own: ``Store.clock_stepped``). Span times are the agents' own
        clocks, and orphan marks and resolutions are stored times, shared with the other
        replicas (a mark is ended by its value)."""
        for run in self._runs.values():
            if run.last_seen:  # 0.0: never seen (a run known from its stored owner only)
                run.last_seen += step
            if run.owner_seen:
                run.owner_seen += step
            if run.lease is not None:
                run.lease = run.lease.moved(step)
            if run.returned is not None:
                run.returned += step
        for watch in self._instances.values():
            watch.at += step
            if watch.lost_at is not None:
                watch.lost_at += step
            if not watch.dead:
                watch.scheduled = watch.due()
        self._compact_dues()  # every due moved: one entry per live watch, at its new due

    def restore_instance(self, instance: str, at: float, interval: float) -> None:
        instance = _intern(instance)
        watch = self._instances[instance] = _Watch(at, interval)
        self._schedule(instance, watch)

    def _schedule(self, instance: str, watch: _Watch) -> None:
        """Queue the moment ``watch`` falls due, after any change to it (once per due)."""
        due = watch.due()
        if due != watch.scheduled:
            watch.scheduled = due
            heapq.heappush(self._dues, (due, instance))
            if len(self._dues) > 2 * len(self._instances) + _DUES_SLACK:
                self._compact_dues()

    def _compact_dues(self) -> None:
        """One entry per live watch: the stale ones dropped. Ticks pop stale entries as
        they fall due; this bounds the queue by the instances kept even when ticks are
        rare (a process's heartbeats push one entry each). Amortized: the queue doubled
        since the last compaction."""
        watches = self._instances
        self._dues = [(w.scheduled, i) for i, w in watches.items() if not w.dead]
        heapq.heapify(self._dues)

    def heard(
        self,
        instance: str,
        at: float,
        interval: float,
        open_runs: Iterable[str],
        now: float,
        retention: float,
        change: int = 0,
    ) -> list[Transition]:
        """A heartbeat another replica received at ``at`` and stored with change number
        ``change``, read by this one at ``now`` (the store hands each row over once;
        ignored when already past the retention: a sync that read it before a prune forgot
        the instance must not bring it back). The orphaned runs it names are revived, as
        by one received here."""
        if _stale(now, at, retention):
            return []
        return self._beat(_intern(instance), at, interval, open_runs, now, change)

    def restore_resolution(self, run_id: str, note: str, at: float, by: str | None = None) -> bool:
        """Apply a resolution read from the store at a start (or a run read back) to a run
        that has none; False when the run is unknown, resolved already, or orphaned after
        it (a replica that orphaned the run before reading the resolution drops it, as
        ``_lapse`` would have had they come in that order)."""
        run = self._runs.get(run_id)
        if run is None or run.resolution is not None or _lapsed_by_mark(run, at):
            return False
        run.resolution = Resolution(note, at, by)
        return True

    def read_resolution(self, run_id: str, stored: Resolution | None) -> bool:
        """Apply a run's resolution as a replica's read of the store found it (``None``:
        the run has none): the mark row's newest version, read by change number and in
        turn with this sidecar's own writes, so it takes the place of the one held here
        whatever its time says (a replacement made through another replica, or none where
        a lapse there cleared it). One made at or before the run's orphan mark lapsed
        (``restore_resolution``'s rule): none stands. True when the run's changed."""
        run = self._runs.get(run_id)
        if run is None:
            return False
        if stored is not None and _lapsed_by_mark(run, stored.at):
            stored = None
        if run.resolution == stored:
            return False
        run.resolution = stored
        return True

    def resolution_time(self, run_id: str, now: float) -> float:
        """When a person's resolution made ``now`` is stamped: ``now``, or just after the
        run's orphan mark when ``now`` is not past it (the same moment, or this replica's
        clock behind the leader's that marked it). The person resolves the situation
        they were shown, the mark included: stamped at or before it, every replica
        (``read_resolution``) would take the resolution for one the mark lapsed."""
        run = self._runs.get(run_id)
        mark = None if run is None else _mark_of(run)
        if mark is None or not _before_mark(now, mark):
            return now
        return mark + RESOLVED_AFTER_MARK_S

    def resolve(self, run_id: str, note: str, now: float, by: str | None = None) -> bool:
        """Record that a person settled the run (``by``: the name they gave, if any).
        False for an unknown run."""
        run = self._runs.get(run_id)
        if run is None:
            return False
        run.resolution = Resolution(note, now, by)
        return True

    # --- ownership and leases (rules: _leases.py) -------------------------------------

    def owner(self, run_id: str) -> Owner | None:
        run = self._runs.get(run_id)
        if run is None:
            return None
        return Owner(run.trace_id, run.instance, run.service)

    def set_owner(self, run_id: str, owner: Owner) -> None:
        """Fix a run's owner (before its first span is folded, or from the store)."""
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _Run(_intern(run_id))
        run.owned = True
        run.trace_id = _intern(owner.trace_id)
        run.instance = _intern(owner.instance)
        if owner.service:
            run.service = _intern(owner.service)

    def lease(self, run_id: str) -> Lease | None:
        run = self._runs.get(run_id)
        return run.lease if run else None

    def set_lease(self, lease: Lease) -> None:
        run = self._runs.get(lease.run_id)
        if run is not None:
            run.lease = lease
            run.status = run.derive()

    def liveness(self, run_id: str, now: float) -> Liveness | None:
        """Whether the run's owner may still be at work: it has not ended the run, is not
        orphaned, and was heard from within the orphan window (heartbeats or spans)."""
        run = self._runs.get(run_id)
        if run is None:
            return None
        watch = self._instances.get(run.instance)
        last: float | None = run.owner_seen or None
        if watch is not None:
            last = max(last or 0.0, watch.at)
        if run.owner_ended() or run.orphaned_at is not None:
            alive = False
            window = self.idle_timeout
        elif watch is not None:
            window = watch.window()
            alive = not watch.dead and now - watch.at <= window
        else:
            window = self.idle_timeout
            alive = now - run.owner_seen <= window
        return Liveness(alive, last, window, run.status, run.returned)

    def prunable(self, now: float, retention: float) -> list[str]:
        """Finished (ended or resolved) runs with no activity for ``retention`` seconds.

        A run still waiting for a person (stuck, compensation failed or orphaned, and not
        resolved) is never pruned, however old: its alert keeps firing until someone
        resolves it, and resolving needs the run."""
        return [
            r.run_id
            for r in self._runs.values()
            if (r.has_ended() or r.resolution is not None)
            and not r.needs_person()
            and now - r.last_seen > retention
        ]

    def stale_instances(self, now: float, retention: float) -> list[str]:
        """Instances whose last heartbeat is older than ``retention`` (dead ones, surely)."""
        return [i for i, watch in self._instances.items() if _stale(now, watch.at, retention)]

    def forget_instances(self, instances: Iterable[str]) -> None:
        # A run of a forgotten instance falls back to the idle-timeout rule, which has
        # long since applied: its process has been silent for the whole retention.
        gone = set(instances)
        for instance in gone:
            self._instances.pop(instance, None)
        for run_id in [r for r in self._watched if self._runs[r].instance in gone]:
            del self._watched[run_id]
            self._idle[run_id] = None

    # --- putting finished runs away (the store serves them; memory holds open runs) ----

    def settled(self, among: Iterable[str] | None = None) -> list[str]:
        """Runs that may leave memory: ended, and needing no person (or resolved); of
        ``among`` only, when given (those still here)."""
        runs = self._runs
        found = runs.values() if among is None else (runs[r] for r in among if r in runs)
        return [r.run_id for r in found if r.run_spans and not r.needs_person()]

    def index_row(self, run_id: str) -> tuple[float, RunStatus, str, float] | None:
        """(started_at, status, saga, last_seen) of a run, for the store's index of runs
        put away; None for an unknown run."""
        run = self._runs.get(run_id)
        if run is None:
            return None
        return (run.started_at, run.status, run.saga, run.last_seen)

    def forget(self, run_ids: Iterable[str]) -> None:
        for run_id in run_ids:
            self._runs.pop(run_id, None)
            self._idle.pop(run_id, None)
            self._recovering.pop(run_id, None)
            self._watched.pop(run_id, None)


_A = TypeVar("_A", DoAttempt, CompAttempt)


def _insert(attempts: tuple[_A, ...], entry: _A) -> tuple[_A, ...]:
    """``attempts`` with ``entry``, kept sorted by (attempt, start, span id).

    Whole tuples compare as that key: the span id in the third place is unique
    within a step's list, so a comparison never reaches the later fields.
    """
    # Concatenation, not (*attempts, entry): mypy cannot type that for a constrained TypeVar.
    if not attempts or attempts[-1] < entry:  # the usual case: later attempt
        return attempts + (entry,)  # noqa: RUF005
    return tuple(sorted(attempts + (entry,)))  # noqa: RUF005


def _attempt_dict(a: DoAttempt | CompAttempt) -> AttemptView:
    return {"attempt": a.attempt, "ok": a.ok, "error": a.error, "start": a.start, "end": a.end}


def _comp_dict(step: _Step, comp: PendingComp) -> CompensationView:
    args = _parse_json(comp.args_text)
    return {
        "step": step.name,
        "index": step.index,
        "tool": comp.tool,
        "args": args if isinstance(args, dict) else {},
        "description": comp.description,
    }


def _summary_key(summary: RunSummary) -> tuple[float | None, str]:
    return (summary["started_at"], summary["run_id"])


def _start_key(run: _Run) -> tuple[float, str]:
    return (run.started_at, run.run_id)


@dataclass(slots=True)
class _Watch:
    """An instance that heart-beats: when its last delivery arrived, how often it beats,
    how its deliveries have been spaced, and whether it died."""

    at: float  # receipt time (sidecar clock) of the last delivery with a heartbeat
    interval: float
    dead: bool = False
    beat: float | None = None  # the last delivery's latest heartbeat time (agent clock)
    # Recent delivery gaps shown: receipt gaps between continuous deliveries, and the
    # span-time spread of one delivery's heartbeats + 1 interval.
    gaps: tuple[float, ...] = ()
    lost_at: float | None = None  # its live connection closed uncleanly, not yet confirmed
    scheduled: float = float("inf")  # the due last queued for it (RunState._dues)

    def learn(self, gap: float) -> None:
        self.gaps = (*self.gaps, gap)[-_GAP_SAMPLES:]

    def beating(self, at: float, heard_at: float | None = None) -> None:
        """A delivery with heartbeats received at ``at`` (ours or another replica's, that
        one read at ``heard_at``): alive, and a connection lost before it (by more than the
        settle) no longer counts."""
        if self.lost_at is not None and at > self.lost_at + PRESENCE_SETTLE:
            self.lost_at = None
        self.at = at if heard_at is None else max(self.at, heard_at)
        self.dead = False

    def delivery_gap(self) -> float:
        """How far apart this instance's deliveries may be: the largest recent gap it has
        shown, capped; an SDK's default batch delay until it has shown one."""
        if not self.gaps:
            return DEFAULT_BATCH_DELAY
        return min(max(self.gaps), MAX_DELIVERY_GAP)

    def window(self) -> float:
        """Silence past this many seconds since the last delivery means the process died."""
        return max(3 * self.interval, self.delivery_gap() + 2 * self.interval)

    def due(self) -> float:
        """The moment past which the process counts as dead, unless it is heard from: its
        silence outlasts the window, or its live connection stays lost past the grace."""
        silent = self.at + self.window()
        return silent if self.lost_at is None else min(silent, self.lost_at + PRESENCE_GRACE)

    def dead_at(self, now: float) -> bool:
        """Whether the process counts as dead at ``now`` (the one rule: past :meth:`due`)."""
        return now > self.due()


def _span_end(span: SpanRecord) -> float:
    return span.end


def _finite(value: float) -> float | None:
    return None if value == float("inf") else value


def _stale(now: float, at: float, retention: float) -> bool:
    """The retention rule for agent instances: last heard longer than ``retention`` ago."""
    return now - at > retention
