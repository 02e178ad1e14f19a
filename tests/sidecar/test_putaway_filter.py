"""The filter in front of the lookup of runs put away (``sidecar/_putaway_filter.py``).

Its one promise: every run id the index holds is a "maybe", whatever the order of
puts, reopenings and prunes, so the store's answer never changes. Against a model
of the index: a row per id with its last_seen and whether it was reopened (back in
memory, status NULL: a prune keeps it), pruned as the store prunes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar._putaway_filter import PutAwayFilter


@dataclass
class _Index:
    """The store's run_index as the filter must see it: id -> (last_seen, reopened)."""

    rows: dict[str, tuple[float, bool]] = field(default_factory=dict)

    def put_away(self, run_id: str, last_seen: float) -> None:
        self.rows[run_id] = (last_seen, False)

    def reopen(self, run_id: str) -> None:
        if run_id in self.rows:
            self.rows[run_id] = (self.rows[run_id][0], True)

    def prune(self, before: float) -> None:
        self.rows = {
            r: (t, reopened) for r, (t, reopened) in self.rows.items() if t >= before or reopened
        }

    def kept_older(self, before: float) -> list[tuple[str, float]]:
        """The rows a prune at ``before`` keeps among the older ones: the reopened."""
        return [(r, t) for r, (t, reopened) in self.rows.items() if t < before and reopened]


_ids = st.sampled_from([f"run-{i:02d}" for i in range(30)])
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.tuples(_ids, st.integers(0, 100)), max_size=6)),
        st.tuples(st.just("reopen"), _ids),
        st.tuples(st.just("prune"), st.integers(0, 110)),
        st.tuples(st.just("restart"), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, slice_items=st.integers(1, 5))
def test_every_run_put_away_is_a_maybe(ops: list[tuple[str, object]], slice_items: int) -> None:
    index = _Index()
    filt = PutAwayFilter(slice_items=slice_items)
    for op, arg in ops:
        if op == "put":
            rows = [(r, float(t)) for r, t in arg]  # type: ignore[attr-defined]
            filt.add(rows)  # before the rows, as the store does
            for run_id, t in rows:
                index.put_away(run_id, t)
        elif op == "reopen":
            index.reopen(str(arg))
        elif op == "prune":
            before = float(arg)  # type: ignore[arg-type]
            index.prune(before)
            filt.pruned(before, index.kept_older(before))
        else:  # a restart rebuilds from the whole index, oldest first
            rows = sorted(((r, t) for r, (t, _) in index.rows.items()), key=lambda x: x[1])
            filt = PutAwayFilter(rows, slice_items=slice_items)
        want = sorted(index.rows)
        assert filt.maybe(want) == want


def test_a_prune_drops_the_slices_wholly_older_than_it() -> None:
    filt = PutAwayFilter([(f"r{i}", float(i)) for i in range(12)], slice_items=4)
    assert filt.slices == 3
    filt.pruned(7.0, [])  # the slice of r4..r7 holds r7, seen at 7: kept
    assert filt.slices == 2
    filt.pruned(8.0, [("r5", 5.0)])  # r5 was reopened: the prune kept its row
    assert filt.slices == 2  # the current slice stays, whatever its age; r5 is added
    assert filt.maybe(["r5", "r8", "r9", "r10", "r11"]) == ["r5", "r8", "r9", "r10", "r11"]


def test_ids_never_put_away_rarely_ask_the_store() -> None:
    """The point of the filter: a new run is nearly always a "certainly not"."""
    filt = PutAwayFilter([(f"away-{i}", 1.0) for i in range(5_000)], slice_items=2_048)
    assert filt.slices == 3
    strangers = [f"new-{i}" for i in range(10_000)]
    # Three slices at 0.1% each: ~30 expected; 200 would be a broken filter.
    assert len(filt.maybe(strangers)) < 200
    assert filt.maybe([f"away-{i}" for i in range(5_000)]) == [f"away-{i}" for i in range(5_000)]


def test_an_empty_slice_size_is_refused() -> None:
    with pytest.raises(ValueError, match="slice_items=0: give at least 1"):
        PutAwayFilter(slice_items=0)
