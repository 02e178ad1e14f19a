"""Keep the cyclic GC's pauses short when the sidecar holds many open runs.

A full collection walks every tracked object: at 100k open runs that is 0.4-0.5 s
with the loop stopped. Run state is acyclic (runs, steps and attempts are freed by
reference counting when pruned), so once it has survived a young collection the
collector has nothing to find in it: ``gc.freeze()`` moves it to the permanent
generation, which no collection walks. Done after start (once the state is
rebuilt) and every ``interval`` seconds, each time right after a young
collection (``gc.collect(1)``), so the short-lived garbage cycles of requests are
collected before the freeze and never frozen.

The cost: a cycle that became garbage after reaching the old generation and
before a freeze is kept until the process ends. The sidecar makes almost none
(requests die young); ``gc.get_freeze_count()`` shows how much is frozen.
Only the ``saga-sidecar serve`` process does
this (it owns its heap); a sidecar embedded in another program does not.
"""

from __future__ import annotations

import asyncio
import gc

FREEZE_INTERVAL = 1.0


def freeze() -> None:
    """Collect the young generations, then freeze every object that survives."""
    gc.collect(1)
    gc.freeze()


async def freeze_loop(interval: float = FREEZE_INTERVAL) -> None:
    """``freeze()`` now and every ``interval`` seconds (a Sidecar background task)."""
    gc.collect()  # once, at start: nothing dead goes into the permanent generation
    gc.freeze()
    while True:
        await asyncio.sleep(interval)
        freeze()
