"""Open the backend a :class:`~sidecar._storage.DbTarget` names: SQLite or PostgreSQL.

Above both backends and ``_storage.py``; the PostgreSQL driver itself is imported
only when a PostgreSQL store opens (``_pgstore._psycopg``).
"""

from __future__ import annotations

from ._pgstore import PgAlertStore, PgStore, pg_history
from ._storage import AlertStore, DbTarget, HistoryRecord, Store
from ._store import SqliteAlertStore, SqliteStore, hold_file, sqlite_history


def open_store(target: DbTarget) -> Store:
    """Open (creating or upgrading the schema) the run store ``target`` names."""
    if target.backend == "postgresql":
        return PgStore(target)
    return SqliteStore(target)


def hold_database(target: DbTarget) -> int | None:
    """Claim the database for this serving process: a SQLite file's lock (one sidecar a
    file, ``hold_file``), the descriptor to close when serving stops; None on
    PostgreSQL, which any number of replicas share."""
    if target.backend == "postgresql":
        return None
    assert target.path is not None
    return hold_file(target.path)


def open_alert_store(target: DbTarget) -> AlertStore:
    """Open the alert outbox's tables in the database ``target`` names."""
    if target.backend == "postgresql":
        return PgAlertStore(target)
    return SqliteAlertStore(target)


def alert_rows(target: DbTarget, run_id: str) -> list[HistoryRecord]:
    """The alert rows of one run, oldest first, on a connection of their own (blocks)."""
    if target.backend == "postgresql":
        return pg_history(target, run_id)
    assert target.path is not None
    return sqlite_history(target.path, run_id)
