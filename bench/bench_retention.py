"""Memory under retention: finished runs accumulate in the store, not in the sidecar.

A week at 100 runs/s is 60.48M runs: too many to run here. This is the same
traffic scaled down and sped up: a child process builds a real Sidecar (state,
store, put-away) without sockets, an injected clock steps one simulated second
at a time, and each second 100 runs start (a do span) and the runs started 5 s
earlier end (a run span). RSS is read as finished runs accumulate. The reference
is the same child with finished runs kept in memory (no put-away), as the sidecar
did before: its RSS grows with every run, which is what a week cannot afford.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench._figures import Figure
from bench._spans import new_request, saga_span
from saga_otel import semconv as sc

ROOT = Path(__file__).resolve().parent.parent
RATE = 100  # runs started per simulated second
RUN_SECONDS = 5  # each run ends this long after it starts (so ~500 runs are open)
TOTAL = 200_000  # finished runs pushed through (about 33 simulated minutes)
FIRST = 50_000  # RSS growth is measured from here (after warm-up) to TOTAL
CHECK_EVERY = 25_000


def _request(starts: range, ends: range, t: float) -> bytes:
    req, spans = new_request()
    for phase, runs in ((sc.PHASE_DO, starts), (sc.PHASE_RUN, ends)):
        for run in runs:
            start = int(t * 1e9) if phase == sc.PHASE_DO else int((t - RUN_SECONDS) * 1e9)
            strings = [
                (sc.SAGA_RUN_ID, f"{run + 1:032x}"),
                (sc.SAGA_NAME, "refund"),
                (sc.SAGA_PHASE, phase),
            ]
            ints = [(sc.SAGA_CONTRACT_VERSION, 1)]
            if phase == sc.PHASE_DO:
                name = sc.do_span_name("issue_credit")
                strings += [
                    (sc.SAGA_STEP_NAME, "issue_credit"),
                    (sc.SAGA_STEP_CLASS, "compensable"),
                    (sc.SAGA_COMPENSATION_TOOL, "reverse_credit"),
                    (sc.SAGA_COMPENSATION_ARGS, f'{{"credit_id": "cr_{run}"}}'),
                ]
                ints += [(sc.SAGA_STEP_INDEX, 0), (sc.SAGA_STEP_ATTEMPT, 1)]
            else:
                name = sc.run_span_name("refund")
                strings.append((sc.SAGA_RUN_STATUS, sc.STATUS_COMPLETED))
            span_id = 2 * run + (phase == sc.PHASE_RUN) + 1
            saga_span(spans, run + 1, span_id, name, start, int(t * 1e9) + 1000, strings, ints)
    return req.SerializeToString()


async def _simulate(db: str, put_away: bool) -> dict[str, object]:
    import psutil  # type: ignore[import-untyped]

    from sidecar import Settings, Sidecar
    from sidecar._backends import open_store
    from sidecar._otlp import extract, parse_protobuf

    t = 1_700_000_000.0
    settings = (
        Settings(db_url=db, idle_timeout=3600.0)
        if db.startswith("postgresql")
        else Settings(db_path=Path(db), idle_timeout=3600.0)
    )
    sidecar = Sidecar(settings, clock=lambda: t)
    sidecar.store = open_store(settings.database)  # no listeners, no sockets: state + store
    process = psutil.Process()
    rss: dict[int, int] = {}
    in_memory: dict[int, int] = {}
    started = ended = second = 0
    evict_every = round(settings.evict_interval)
    while ended < TOTAL:
        starts = range(started, started + RATE)
        ends = range(ended, ended + RATE) if second >= RUN_SECONDS else range(0)
        body = _request(starts, ends, t)
        await sidecar.ingest(extract(parse_protobuf(body), body), "bench")
        started += len(starts)
        ended += len(ends)
        second += 1
        t += 1.0
        if put_away and second % evict_every == 0:
            await sidecar.evict_async()
        if ended and ended % CHECK_EVERY == 0:
            gc.collect()
            rss[ended] = process.memory_info().rss
            in_memory[ended] = len(sidecar.state)
    sidecar.store.close()
    return {"rss": rss, "in_memory": in_memory, "seconds": second}


def _child(db: str, put_away: bool) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_retention", db, "1" if put_away else "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(progress: Callable[[str], None]) -> list[Figure]:
    growth: dict[bool, float] = {}
    held: dict[bool, int] = {}
    db_bytes = 0
    for put_away in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            db = Path(tmp) / "sidecar.db"
            got = _child(str(db), put_away)
            if put_away:
                db_bytes = sum(p.stat().st_size for p in Path(tmp).iterdir())
        rss = {int(k): int(v) for k, v in got["rss"].items()}  # type: ignore[attr-defined]
        memory = {int(k): int(v) for k, v in got["in_memory"].items()}  # type: ignore[attr-defined]
        growth[put_away] = (rss[TOTAL] - rss[FIRST]) / (TOTAL - FIRST)
        held[put_away] = memory[TOTAL]
        label = "put away" if put_away else "kept in memory"
        curve = ", ".join(f"{k // 1000}k: {v / 2**20:.0f} MiB" for k, v in sorted(rss.items()))
        progress(f"finished runs {label}: RSS {curve}; runs in memory at the end {memory[TOTAL]}")
    ratio = growth[True] / growth[False] if growth[False] > 0 else 0.0
    per_run_disk = db_bytes / TOTAL
    week = 100 * 86_400 * 7
    return [
        Figure(
            area="sidecar",
            name=f"RSS growth per finished run, {TOTAL:,} runs at {RATE} runs/s (simulated)",
            value=growth[True],
            unit="bytes",
            reference_name="same traffic, finished runs kept in memory",
            reference_value=growth[False],
            ratio=ratio,
            goal="<= 0.05",
            met=ratio <= 0.05,
            notes=(
                f"a week of retention at {RATE} runs/s is {week / 1e6:.2f}M runs; scaled down: "
                "a child process pushes runs through the real state, SQLite store and "
                f"put-away (no sockets) with an injected clock, {RATE} runs starting and "
                f"{RATE} ending per simulated second ({RUN_SECONDS} s each, so ~"
                f"{RATE * RUN_SECONDS} open), RSS read from {FIRST:,} to {TOTAL:,} finished "
                f"runs. With put-away the sidecar held {held[True]:,} runs at the end (the "
                f"open ones and those finished in the last evict interval); the reference "
                f"held {held[False]:,}. The bound: memory = (open runs + runs finished "
                "within the evict interval, 10 s) x RSS per open run (figure "
                "above); at 100 runs/s that is ~1,000 finished runs beside the open ones, "
                "whatever the retention. The store holds the week instead: "
                f"{per_run_disk:,.0f} bytes per run on SQLite here, so about "
                f"{per_run_disk * week / 2**30:,.0f} GiB for a week of these 2-span runs"
            ),
        )
    ]


if __name__ == "__main__":
    result = asyncio.run(_simulate(sys.argv[1], sys.argv[2] == "1"))
    print(json.dumps(result))
