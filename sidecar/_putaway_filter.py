"""Which run ids may be in the index of runs put away: a filter in front of the lookup.

Every request that opens a run asks the store whether the run was put away (a late
span of a finished run must be folded onto the whole run). Nearly always it was
not, and on SQLite that question cost a read transaction per group commit, about
5% of the server's CPU on single-span requests. A Bloom filter (rbloom: Rust, the
``set`` API, Python's own randomized ``hash`` for strings, so ids an agent picks
cannot aim at its buckets) answers "certainly not" without the store; "maybe" still
asks it, so an answer never changes, only its cost.

It holds every id the store's index holds and may hold more. The store that owns
it adds each id before the index row is written and rebuilds it only from the
index: one sidecar process per SQLite file (docs/scaling.md), so no other writer
can add a row it did not see. Pruning drops whole slices: ids are kept in slices
of SLICE_ITEMS, each knowing its newest ``last_seen``; a prune deletes every row
older than ``before`` except the reopened ones (runs back in memory), so it drops
the slices wholly older than that and adds those reopened rows again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rbloom import Bloom

# Ids per slice, and each slice's false positive rate: ~1.8 bytes an id (a slice is
# 460 KiB from its start); a million runs is 4 slices, so about 0.4% of new runs still
# ask the store, and a lookup checks each id against 4 filters (~50 ns each).
SLICE_ITEMS = 262_144
FALSE_POSITIVES = 0.001


class _Slice:
    __slots__ = ("bloom", "count", "newest")

    def __init__(self, items: int) -> None:
        self.bloom = Bloom(items, FALSE_POSITIVES)
        self.count = 0
        self.newest = float("-inf")


class PutAwayFilter:
    """Run ids that may be put away (a superset of the store's index), in time slices."""

    __slots__ = ("_items", "_slices")

    def __init__(
        self, rows: Iterable[tuple[str, float]] = (), slice_items: int | None = None
    ) -> None:
        """``rows``: (run_id, last_seen) of the index, oldest first for tight slices."""
        self._items = SLICE_ITEMS if slice_items is None else slice_items
        if self._items < 1:
            raise ValueError(f"slice_items={slice_items!r}: give at least 1 id per slice")
        self._slices: list[_Slice] = [_Slice(self._items)]
        self.add(rows)

    def add(self, rows: Iterable[tuple[str, float]]) -> None:
        """Ids put away, with their rows' ``last_seen`` (epoch seconds)."""
        rows = rows if isinstance(rows, list) else list(rows)
        items = self._items
        start = 0
        while start < len(rows):
            current = self._slices[-1]
            if current.count >= items:
                current = _Slice(items)
                self._slices.append(current)
            # A slice's worth at once: rbloom's update is a loop in Rust (a million
            # ids: ~0.05 s, against ~0.2 s an id at a time).
            chunk = rows[start : start + items - current.count]
            current.bloom.update([run_id for run_id, _ in chunk])
            current.count += len(chunk)
            current.newest = max(current.newest, max(seen for _, seen in chunk))
            start += len(chunk)

    def maybe(self, run_ids: Sequence[str]) -> list[str]:
        """The ids of ``run_ids`` that may be put away (the rest certainly are not)."""
        slices = self._slices
        if len(slices) == 1:  # up to SLICE_ITEMS runs put away: one check an id
            bloom = slices[0].bloom
            return [r for r in run_ids if r in bloom]
        blooms = [s.bloom for s in slices]
        out = []
        for r in run_ids:
            for bloom in blooms:
                if r in bloom:
                    out.append(r)
                    break
        return out

    def pruned(self, before: float, kept: Iterable[tuple[str, float]]) -> None:
        """Every index row last seen before ``before`` was deleted but ``kept`` (the
        reopened ones): drop the slices that hold only older ids (the current slice
        stays), then add ``kept`` again."""
        last = self._slices[-1]
        newer = [s for s in self._slices[:-1] if s.newest >= before]
        self._slices = [*newer, last]
        self.add(kept)

    @property
    def slices(self) -> int:
        """Slices held (each SLICE_ITEMS ids at most): what pruning dropped shows here."""
        return len(self._slices)
