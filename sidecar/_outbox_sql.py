"""The alert outbox's reads, written once for both backends.

SQLite and PostgreSQL run the same SQL here; only the driver's placeholder differs
(``?`` for sqlite3, ``%s`` for psycopg), so each store names its placeholder and
inherits these methods. Claims and writes stay with each store: they differ
(PostgreSQL claims rows across replicas, SQLite has one process per file).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from ._storage import OutboxRecord

ROW = "SELECT id, dedup_key, action, sink, state, attempts, last_error, event FROM alert_outbox"


class _Reads(Protocol):
    placeholder: ClassVar[str]

    def _all(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]: ...


def sql(store: _Reads, text: str) -> str:
    """``text`` (written with ``?``) in the store's driver's placeholder."""
    return text if store.placeholder == "?" else text.replace("?", store.placeholder)


class OutboxReads:
    """The read half of :class:`sidecar._storage.AlertStore`, shared by both stores."""

    def held(self: _Reads, no_sink: str, held: str) -> list[tuple[int, str]]:
        rows = self._all(
            sql(
                self, "SELECT id, event FROM alert_outbox WHERE sink = ? AND state = ? ORDER BY id"
            ),
            (no_sink, held),
        )
        return [(int(a), str(b)) for a, b in rows]

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
        query = sql(self, "SELECT COUNT(*) FROM alert_outbox WHERE state = ?")
        ((n,),) = self._all(query, (state,))
        return int(n)

    def firing(self: _Reads, sink: str, delivered: str) -> list[tuple[int, float, str]]:
        rows = self._all(
            sql(
                self,
                "SELECT f.id, f.last_sent_at, f.event FROM alert_outbox f WHERE f.sink = ? "
                "AND f.action = 'fire' AND f.state = ? AND NOT EXISTS (SELECT 1 FROM "
                "alert_outbox r WHERE r.dedup_key = f.dedup_key AND r.sink = f.sink AND "
                "r.action = 'resolve')",
            ),
            (sink, delivered),
        )
        return [(int(a), float(b or 0.0), str(c)) for a, b, c in rows]
