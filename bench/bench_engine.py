"""The engine against its peers: the same 3-step run in saga-otel, agent-saga and sagaz.

``bench/peer_harness.py`` times the run in a fresh process per library:
saga-otel with full telemetry (SDK spans, the default JSON log lines, metrics)
with the project's Python; agent-saga 2.3.11 and sagaz 1.5.0, without
telemetry, from a bench-only environment ``bench/.peers-venv`` that this bench
creates with pip when it is missing (never the project's dependencies). The
three processes alternate, ``REPEATS`` times, so each repetition sees the same
machine moments; the figure is the median of the repetitions, the notes give
the spread of the per-repetition ratios.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import venv
from collections.abc import Callable
from pathlib import Path

from bench._figures import Figure

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "peer_harness.py"
PEERS_VENV = HERE / ".peers-venv"
PEERS = ("agent-saga==2.3.11", "sagaz==1.5.0")
REFERENCE = "agent_saga"
REPEATS = 5
RUNS = 200
GOAL = 0.5
# What was tried and what is left, for goals not reached (docs/benchmarks.md notes).
NOTES_OK = (
    "Tried (issue 16): the observe-path work (the default logger as the structlog bound "
    "logger itself with one orjson processor and no lazy proxy, the attempt as one slotted "
    "object with per-step-kind attributes and metric children, one JSON encode per "
    "compensation), tool async-ness computed once, no tenacity wrapper (the one retry loop "
    "is our own, now saga_otel._outcome.retrying), the call scope a slotted "
    "class instead of a generator context manager, no snapshot layer for a tool without a "
    "snapshot, the pure stack's state evolved by direct construction (one per event) "
    "instead of dataclasses.replace, run/unwind/compensation metric children cached. "
    "Profile after (cProfile, 3,000 ok runs): SDK spans about 40% (starting four spans with "
    "attribute cleaning 29%, set_attributes for the run identity, the three pushes and the "
    "run's end 8%, end and status 4%), the outcome combinators' closures about 9%, JSON log "
    "lines about 8%, the pure stack about 5%, building the three Compensation records about "
    "4%, metrics about 3%; the rest (the report, heartbeat registration, call contexts) is "
    "spread thin. agent-saga does no telemetry at all on this path: at 0.5 its time, the "
    "SDK spans alone take most of the budget. Second pass: the observe-path trims (per-kind "
    "start-attribute templates, cheaper id hexing and timestamps) apply here too; an A/B of "
    "the saga-otel harness alone (base vs after, interleaved with agent-saga) was within the "
    "machine's noise while other helpers ran (ok runs 0.41-0.69 ms either way), so no engine "
    "gain is claimed. Third pass: the frozen records built on every step (the stack's "
    "state, step records, call contexts and infos, ack tickets, queue items, the report) "
    "get an __init__ that stores through the slots' descriptors (saga_otel/_frozen.py; the "
    "dataclass's own cost object.__setattr__ per field, 13 for the stack's state: 1.34 -> "
    "0.74 us), and the stack's evolve is a replace made once per set of changed fields "
    "(2.19 -> 0.94 us); in process, 3 interleaved pairs of 3 s each, the ok run 0.261-0.279 "
    "-> 0.244-0.249 ms. Profile after (py-spy at 1 kHz, 8 s of ok runs, self time): the "
    "SDK's span start, attribute cleaning and end about 25%, the outcome combinators' "
    "frames about 7%, the JSON log lines about 6% (the timestamp 2%), building and "
    "encoding the three compensations about 4%, metrics about 2%; the rest under 1% a "
    "function. Remaining cost centres are those; the largest the library owns is the "
    "outcome combinators' frames. Fourth pass, tried and dropped: fusing the async "
    "outcome's leaves (pure as a value that then() takes without awaiting; map() on a "
    "call leaf extending it instead of nesting a coroutine): the forward call's "
    "combinator chain alone 3.95 -> 4.68 us (a subclass __init__ and the call's lambda "
    "cost more than the coroutine frames they replace), the ok run 0.238-0.241 -> "
    "0.243-0.251 ms in 3 interleaved pairs. Profile at this pass (py-spy at 1 kHz, 8 s "
    "of ok runs, self time by file): the SDK about 32% (span start and end 15%, "
    "attribute cleaning 11%, sampling 3%); the library's own code about 55%, spread over "
    "the engine (15%), telemetry (11%), the outcome layer (9%), the log lines (5%), the "
    "generated record inits and copies (4%), records (4%) and the pure stack (3%), no line "
    "above 1%: no single lever is left, only a leaner engine as a whole. Then landed: "
    "the policies written as scripts (generators yielding the calls, sleeps and ack waits "
    "they need, run by one sync and one async driver loop, saga_otel/_outcome.py) instead "
    "of combinator chains: a forward call's policy alone (micro-bench: a call in a with "
    "block, retried once at most, then settled) 3.95 -> 1.03 us; the ok run in process, 4 "
    "interleaved pairs, 0.234-0.251 -> 0.234-0.240 ms (the SDK and the log lines are most "
    "of it); the library's own share by file after it (py-spy, self time): the engine "
    "15%, telemetry 12%, the outcome layer 6% (from 9%), the log lines 5%."
)
NOTES_FAIL = (
    "Tried: cheap exception recording (the SDK's record_exception formatted the whole "
    "traceback with source lines, about 30% of a failed run; now type, message and the 16 "
    "innermost frames without source lines, and the exception line without building a "
    "TracebackException, the same event and attributes), and the ok run's work above. "
    "Profile after (cProfile, 3,000 failing runs): SDK spans about 35% (seven: the run, "
    "three do, the unwind and two compensate), the outcome combinators about 10%, the "
    "unwind moment (its span, the stack JSON, its log line) 8%, JSON log lines (eight) "
    "about 6%, the shielded unwind's task and loop turn about 4%, the pure stack about 4%, "
    "metrics about 3%, recording the exception about 3%. The shield (the unwind runs to its "
    "end even if the caller is cancelled) and every span, log line and metric stay. Not "
    "tried in the second pass (time box): a cheaper uncancellable unwind than asyncio.shield "
    "of a task, and a single-attempt async path with fewer Pending objects. Third pass "
    "(measured): cyclic GC is about 7% of a failing run (gc callbacks: 2,068 collections, "
    "312 ms in 4.3 s of failing runs, against 116 in the same time of ok runs). Each "
    "failing run leaves about 174 objects in reference cycles (gc.DEBUG_SAVEALL): the "
    "agent's exception -> its traceback -> the frames it passed -> the Run -> its report -> "
    "report.error, the original exception, which SagaReport promises unchanged; so the "
    "cycle is part of the contract, and gc.disable() moved a failing run only 0.514 -> "
    "0.501 ms (noise). The per-step record work of the ok run applies here too. Fourth "
    "pass: the scripts of the ok run's notes; the unwind (each undo retried, its span, "
    "its ack, the fence) is one loop in one generator instead of a combinator chain per "
    "compensation: in process, 4 interleaved pairs, 0.485-0.488 -> 0.433-0.473 ms, and "
    "fewer objects for the collector (3 s of failing runs: 1,718 -> 1,284 collections, "
    "257 -> 168 ms). Profile after (py-spy, 8 s of failing runs): the shielded unwind's "
    "task and its loop turns (the event loop's select, the task machinery) about 6%, the "
    "unwind moment's span and stack JSON about 9%, recording the exception about 3%. "
    "Not tried: starting the unwind eagerly in the caller's task and handing it to a "
    "task only at its first real suspension (it would save the task only when no undo "
    "waits for I/O, which is this bench, not an agent's undo)."
)


def _peers_python(progress: Callable[[str], None]) -> Path:
    python = PEERS_VENV / "bin" / "python"
    stamp = PEERS_VENV / ".installed"
    if stamp.exists() and stamp.read_text() == " ".join(PEERS):
        return python
    progress(f"creating {PEERS_VENV.relative_to(HERE.parent)} with {', '.join(PEERS)}")
    venv.create(PEERS_VENV, with_pip=True, clear=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PEERS],
        check=True,
    )
    stamp.write_text(" ".join(PEERS))
    return python


def _once(python: Path | str, lib: str) -> dict[str, float]:
    out = subprocess.run(
        [str(python), str(HARNESS), lib, "--runs", str(RUNS)],
        check=True,
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    return {"ok": float(got["ok_ms"]), "fail": float(got["fail_ms"])}


def _spread(xs: list[float]) -> str:
    s = sorted(xs)
    return f"{s[0]:.2f} / {statistics.median(s):.2f} / {s[-1]:.2f}"


def run(progress: Callable[[str], None]) -> list[Figure]:
    peers = _peers_python(progress)
    libs: dict[str, Path | str] = {"saga_otel": sys.executable, "agent_saga": peers, "sagaz": peers}
    got: dict[str, list[dict[str, float]]] = {lib: [] for lib in libs}
    for rep in range(REPEATS):
        progress(f"repetition {rep + 1}/{REPEATS}: {', '.join(libs)} ({RUNS} runs each way)")
        for lib, python in libs.items():
            got[lib].append(_once(python, lib))

    def med(lib: str, kind: str) -> float:
        return statistics.median(r[kind] for r in got[lib])

    def ratios(lib: str, kind: str) -> list[float]:
        return [a[kind] / b[kind] for a, b in zip(got[lib], got[REFERENCE], strict=True)]

    how = (
        f"bench/peer_harness.py: three async compensable steps, each undo taking the id its "
        f"do returned; 'failing' raises in step 3, so steps 2 and 1 are undone. Per run, the "
        f"median of 3 batches of {RUNS} runs after 50 warm-up, one fresh process per library, "
        f"the libraries alternating {REPEATS} times; the value is the median repetition. "
    )
    figures: list[Figure] = []
    for kind, label, notes in (
        ("ok", "ok", NOTES_OK),
        ("fail", "failing at step 3", NOTES_FAIL),
    ):
        ours, ref = med("saga_otel", kind), med(REFERENCE, kind)
        figures.append(
            Figure(
                area="engine",
                name=f"3-step run, {label}, full telemetry",
                value=ours,
                unit="ms/run",
                reference_name=f"agent-saga 2.3.11 without telemetry, {label}",
                reference_value=ref,
                ratio=ours / ref,
                goal=f"<= {GOAL}",
                met=ours / ref <= GOAL,
                notes=(
                    how + "saga-otel: SDK TracerProvider (no exporter), the default JSON log "
                    "lines into a discarding stream, a private metrics registry. Ratio per "
                    f"repetition min/median/max {_spread(ratios('saga_otel', kind))}. {notes}"
                ).strip(),
            )
        )
        peer = med("sagaz", kind)
        figures.append(
            Figure(
                area="engine",
                name=f"peer: sagaz 1.5.0 3-step run, {label}, without telemetry",
                value=peer,
                unit="ms/run",
                reference_name=f"agent-saga 2.3.11 without telemetry, {label}",
                reference_value=ref,
                ratio=peer / ref,
                goal="",
                met=True,
                notes=(
                    how + "sagaz: Saga.add_step with each step depending on the last, "
                    f"max_retries=0. Ratio per repetition min/median/max "
                    f"{_spread(ratios('sagaz', kind))}."
                ),
            )
        )
    return figures
