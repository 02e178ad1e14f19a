"""Finished runs put away from memory: how stored runs are folded back, and listed.

A sidecar holds the runs that may still change or need a person (open, unwinding,
orphaned, compensation failed or stuck and unresolved) and the runs finished in
the last ``evict_interval``; every other run lives only in the store, indexed by
``Store.put_away``. Its view is a function of its stored spans and marks, so a
run folded back from the store (:func:`fold_stored`) gives the same view it had
in memory: at start, when a late span or a person reaches it, and for a read
(into a scratch :class:`RunState` that is dropped after the answer).
"""

from __future__ import annotations

from collections.abc import Iterable

from ._errors import SidecarError
from ._leases import Lease, Owner
from ._log import get_logger
from ._otlp import SpanRecord, span_from_stored
from ._state import RunState
from ._storage import RunMark, RunQuery, StoredSpan
from ._views import RunSummary

log = get_logger("sidecar")


def fold_stored(
    state: RunState,
    spans: Iterable[StoredSpan],
    owners: Iterable[tuple[str, Owner]],
    marks: Iterable[RunMark],
    leases: Iterable[Lease],
    now: float,
) -> int:
    """Fold stored runs into ``state`` (no listener hears: this is known history), one
    run's spans at a time; the number of spans read. ``spans`` come grouped by run."""
    for run_id, owner in owners:
        if state.owner(run_id) is None:
            state.set_owner(run_id, owner)
    batch: list[SpanRecord] = []
    current = None
    count = 0
    for stored in spans:
        if stored.run_id != current and batch:
            state.apply(batch, now)
            batch = []
        current = stored.run_id
        try:
            batch.append(span_from_stored(stored.data, stored.service, stored.instance))
        except SidecarError as exc:
            log.warning("sidecar.rebuild.span_skipped", span_id=stored.span_id, error=str(exc))
        count += 1
    if batch:
        state.apply(batch, now)
    for mark in marks:
        if mark.orphaned_at is not None:
            state.restore_orphaned(mark.run_id, mark.orphaned_at)
        if mark.resolution_at is not None:
            state.restore_resolution(
                mark.run_id, mark.resolution_note or "", mark.resolution_at, mark.resolution_by
            )
    for lease in leases:
        state.set_lease(lease)
    return count


def summary_key(summary: RunSummary) -> tuple[float, str]:
    """The listing order and page cursor: (started_at, run_id), newest first."""
    started = summary["started_at"]
    return (started if started is not None else float("-inf"), summary["run_id"])


def matches(summary: RunSummary, query: RunQuery) -> bool:
    """Whether a summary of a run read from the store passes ``query`` (the index row of
    a reopened run has no status: its summary decides)."""
    if query.status is not None and summary["status"] != query.status:
        return False
    return query.before is None or summary_key(summary) < query.before
