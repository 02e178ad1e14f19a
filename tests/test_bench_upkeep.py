"""bench/bench_upkeep.py measures what it says: its files hold runs the store counts as
put away (so a start has nothing to fold), and both prunes delete every one of them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench import bench_upkeep
from sidecar import _server
from sidecar._store import SqliteStore


def test_the_generated_runs_are_put_away_as_the_store_would_put_them(tmp_path: Path) -> None:
    path = tmp_path / "big.db"
    bench_upkeep._template(path, 50, 2, 86_400.0, 100)
    store = SqliteStore(path)
    try:
        ids = [f"{i:032x}" for i in range(50)]
        assert store.put_away_of(ids) == set(ids)
        assert store.owners() == [] and list(store.spans()) == []  # nothing for a start
        assert store.span_count() == 100
    finally:
        store.close()


@pytest.mark.parametrize("batched", [False, True])
def test_both_prunes_delete_every_run_past_the_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool
) -> None:
    monkeypatch.setattr(bench_upkeep, "PRUNED", 30)
    monkeypatch.setattr(_server, "PRUNE_BATCH", 7)  # several batches
    template = tmp_path / "backlog.db"
    bench_upkeep._template(template, 30, 3, 10_800.0, 100)
    db = bench_upkeep._copy(template, tmp_path / "p.db")
    longest, took, deleted = asyncio.run(bench_upkeep._prune_stalls(db, batched))
    assert deleted == 30 and 0 < longest <= took
    store = SqliteStore(db)
    try:
        assert store.span_count() == 0
        assert store.put_away_of([f"{i:032x}" for i in range(30)]) == set()
    finally:
        store.close()
