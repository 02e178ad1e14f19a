"""The alert outbox's reads, written once for both backends.

SQLite and PostgreSQL run the same SQL here; only the driver's placeholder differs
(``?`` for sqlite3, ``%s`` for psycopg), so each store names its placeholder and
inherits these methods. Claims and writes stay with each store: they differ
(PostgreSQL claims rows across replicas, SQLite has one process per file).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Final, Protocol

from ._storage import OutboxRecord

# A row's delivery state: waiting for its sink (pending), kept for a sink no configured
# one is (held), or done: delivered, refused by the sink for good (failed), or handed to
# the sinks of a later start that no longer configures its own (rehomed, Outbox.rehome).
PENDING: Final = "pending"
DELIVERED: Final = "delivered"
FAILED: Final = "failed"
HELD: Final = "held"
REHOMED: Final = "rehomed"

ROW = "SELECT id, dedup_key, action, sink, state, attempts, last_error, event FROM alert_outbox"
# Outbox depth: served by the index on state (schema 4), so it costs what is pending,
# not what the outbox ever held (it runs after every write and every delivery).
COUNT_IN_STATE = "SELECT COUNT(*) FROM alert_outbox WHERE state = ?"
# A fire still firing: delivered (the state {state}), no resolve row written since (the
# resolve marks it, RESOLVE_FIRE).
_STILL_FIRING = "action = 'fire' AND resolved_at IS NULL AND state = {state}"
# Fires still firing, delivered to a sink that re-sends them (Alertmanager): read after
# every delivery, so served by the partial index alert_outbox_firing (schema 4) and as
# cheap as what is firing, however many fires were resolved since.
FIRING = "SELECT id, last_sent_at, event FROM alert_outbox WHERE sink = ? AND " + (
    _STILL_FIRING.format(state="?")
)
# A fire to re-send now: still firing, and not sent since {due}. Checked again as its
# re-send is claimed (AlertStore.resending): the list was read before, and a resolve may
# have been written since, or another replica may have re-sent it.
RESEND_DUE = _STILL_FIRING + " AND (last_sent_at IS NULL OR last_sent_at <= {due})"
RESOLVE_FIRE = (
    "UPDATE alert_outbox SET resolved_at = ? WHERE dedup_key = ? AND sink = ? "
    "AND action = 'fire' AND resolved_at IS NULL"
)
# Pruning a run takes its alert rows along once nothing is left to do for them: none of
# them waits for a sink and every fire is resolved (its resolved_at mark, as FIRING reads
# it). A run with an alert still waiting or still firing keeps them all (the outbox never
# drops an alert, and Alertmanager keeps getting a firing one). Arguments: the run id,
# twice.
PRUNE_RUN_ALERTS = (
    "DELETE FROM alert_outbox WHERE run_id = ? AND NOT EXISTS (SELECT 1 FROM alert_outbox o "
    f"WHERE o.run_id = ? AND (o.state IN ('{PENDING}', '{HELD}') OR (o.action = 'fire' AND "
    "o.resolved_at IS NULL)))"
)
# A waiting row (pending or held) ended without a send, its rows written for other sinks
# (Outbox.rehome): the state and why (as its last error, for the run page). A fire no
# longer fires on its sink (FIRING, and pruning: the run's alerts go once the new rows
# are done). Only while it still waits: a replica may have ended it first. Arguments:
# state, note, time, id.
RETIRE = (
    "UPDATE alert_outbox SET state = ?, last_error = ?, resolved_at = CASE WHEN action = "
    "'fire' THEN COALESCE(resolved_at, ?) ELSE resolved_at END WHERE id = ? AND state IN "
    f"('{PENDING}', '{HELD}')"
)
# A row kept for no sink (held) again: it was handed to sinks before, and the start that
# rehomes their rows configures none that routes it. Arguments: dedup key, action, sink.
HOLD_AGAIN = (
    f"UPDATE alert_outbox SET state = '{HELD}', last_error = NULL WHERE dedup_key = ? "
    "AND action = ? AND sink = ?"
)
# An alert's text masked again (AlertService.remask): arguments the event JSON, the id.
SET_EVENT = "UPDATE alert_outbox SET event = ? WHERE id = ?"
# The rows whose event may still be sent, by id and run (AlertService.remask): those
# waiting (the state index; arguments pending, held), and a sink's fires still firing,
# re-sent to an Alertmanager and repeated by their resolves (the partial index
# alert_outbox_firing; arguments the sink, delivered).
WAITING = "SELECT id, run_id FROM alert_outbox WHERE state IN (?, ?)"
FIRING_RUNS = "SELECT id, run_id FROM alert_outbox WHERE sink = ? AND " + (
    _STILL_FIRING.format(state="?")
)
_IDS_PER_READ: Final = 500  # one IN list: under SQLite's bound on host parameters


# Schema step 4 of both stores (their _STEPS), in each one's words for adding a column:
# marks the fires resolved so far, then the indexes the per-alert reads above go through.
OUTBOX_V4 = """
ALTER TABLE alert_outbox {add} resolved_at {real};
UPDATE alert_outbox SET resolved_at = (SELECT MIN(r.created_at) FROM alert_outbox r
    WHERE r.dedup_key = alert_outbox.dedup_key AND r.sink = alert_outbox.sink
    AND r.action = 'resolve') WHERE action = 'fire';
CREATE INDEX IF NOT EXISTS alert_outbox_state ON alert_outbox (state);
CREATE INDEX IF NOT EXISTS alert_outbox_firing ON alert_outbox (sink, state)
    WHERE action = 'fire' AND resolved_at IS NULL;
"""


class _Driver(Protocol):
    placeholder: ClassVar[str]


class _Reads(_Driver, Protocol):
    def _all(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]: ...


def sql(store: _Driver, text: str) -> str:
    """``text`` (written with ``?``) in the store's driver's placeholder."""
    return text if store.placeholder == "?" else text.replace("?", store.placeholder)


class OutboxReads:
    """The read half of :class:`sidecar._storage.AlertStore`, shared by both stores."""

    def stranded(self: _Reads, sinks: Sequence[str], no_sink: str) -> list[tuple[int, str, str]]:
        """(id, sink, event JSON) of the rows waiting for no sink of ``sinks``, oldest
        first: held ones (``no_sink``) and pending ones of a sink not among them."""
        others = (*sinks, no_sink)
        rows = self._all(
            sql(
                self,
                "SELECT id, sink, event FROM alert_outbox WHERE (sink = ? AND state = ?) OR "
                f"(state = ? AND sink NOT IN ({', '.join('?' * len(others))})) ORDER BY id",
            ),
            (no_sink, HELD, PENDING, *others),
        )
        return [(int(a), str(b), str(c)) for a, b, c in rows]

    def to_leave(self: _Reads, sinks: Sequence[str]) -> list[tuple[int, str]]:
        """(id, run id) of the rows whose event may still be sent: waiting (pending, held),
        or fires still firing on one of ``sinks``."""
        rows = self._all(sql(self, WAITING), (PENDING, HELD))
        for sink in sinks:
            rows += self._all(sql(self, FIRING_RUNS), (sink, DELIVERED))
        return [(int(a), str(b)) for a, b in rows]

    def events(self: _Reads, ids: Sequence[int]) -> list[tuple[int, str]]:
        """(id, event JSON) of the rows ``ids`` (those still there), oldest first."""
        rows: list[tuple[Any, ...]] = []
        for start in range(0, len(ids), _IDS_PER_READ):
            chunk = ids[start : start + _IDS_PER_READ]
            query = (
                f"SELECT id, event FROM alert_outbox WHERE id IN ({', '.join('?' * len(chunk))})"
            )
            rows += self._all(sql(self, query), tuple(chunk))
        return sorted((int(a), str(b)) for a, b in rows)

    def open_alerts(self: _Reads) -> list[tuple[str, str]]:
        rows = self._all(
            "SELECT DISTINCT f.run_id, f.alertname FROM alert_outbox f WHERE f.action = "
            "'fire' AND NOT EXISTS (SELECT 1 FROM alert_outbox r WHERE r.dedup_key = "
            "f.dedup_key AND r.action = 'resolve')"
        )
        return [(str(a), str(b)) for a, b in rows]

    def rows(self: _Reads, sink: str | None = None) -> list[OutboxRecord]:
        query = sql(self, ROW + (" WHERE sink = ?" if sink else "") + " ORDER BY id")
        return [OutboxRecord(*r) for r in self._all(query, (sink,) if sink else ())]

    def count(self: _Reads, state: str) -> int:
        ((n,),) = self._all(sql(self, COUNT_IN_STATE), (state,))
        return int(n)

    def firing(self: _Reads, sink: str, delivered: str) -> list[tuple[int, float, str]]:
        rows = self._all(sql(self, FIRING), (sink, delivered))
        return [(int(a), float(b or 0.0), str(c)) for a, b, c in rows]
