"""Heartbeats (saga_otel._heartbeat): a beat whose run list would make its span larger
than ``max_span_bytes`` goes as several spans (its parts), each within the bound, and a
real sidecar keeps every run of that process running."""

from __future__ import annotations

import io
import itertools
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from support import SidecarProcess, wait_until

from saga_otel import Saga, ToolRegistry, configure, tool
from saga_otel import semconv as sc
from saga_otel._heartbeat import (
    Heartbeat,
    open_run_ids,
    register_open_run,
    split_open_runs,
    unregister_open_run,
)
from saga_otel._logging import json_lines_logger
from saga_otel._state import STATE
from saga_otel._wire import encode, string_item_bytes
from saga_otel.testing import contract_violations


@pytest.fixture
def fresh() -> Iterator[None]:
    yield
    STATE.reset()


def _runs(span: ReadableSpan) -> list[str]:
    return list((span.attributes or {})[sc.SAGA_HEARTBEAT_OPEN_RUNS])  # type: ignore[arg-type]


def _beats(provider: TracerProvider, max_span_bytes: int) -> tuple[Heartbeat, Callable[[], Any]]:
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    logger = json_lines_logger(io.StringIO())
    return Heartbeat(provider, 1.0, logger, max_span_bytes=max_span_bytes), (
        exporter.get_finished_spans
    )


def test_a_beat_of_2000_open_runs_goes_in_parts_each_within_max_span_bytes(fresh: None) -> None:
    """At max_span_bytes=65536, 2,000 open runs made one ~72 KB heartbeat: the processor
    dropped every one (a heartbeat has no marker) and the sidecar paged each run of the live
    process orphaned. The resource counts too (the processor measures the whole request)."""
    resource = Resource.create(
        {sc.SERVICE_NAME: "agent", sc.SERVICE_INSTANCE_ID: "i-1", "k8s.pod.labels": "x" * 3000}
    )
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    heartbeat, finished = _beats(provider, max_span_bytes=65536)
    ids = [f"refund-{uuid.uuid4()}" for _ in range(2000)]
    for run_id in ids:
        register_open_run(run_id)
    try:
        heartbeat.emit(open_run_ids())
        heartbeat.emit(open_run_ids())
    finally:
        for run_id in ids:
            unregister_open_run(run_id)
    spans = finished()
    for span in spans:
        assert len(encode([span])) <= 65536, len(encode([span]))
    assert contract_violations(spans) == []
    for number in (1, 2):
        beat = [s for s in spans if (s.attributes or {})[sc.SAGA_HEARTBEAT_BEAT] == number]
        assert len(beat) > 1
        assert {(s.attributes or {})[sc.SAGA_HEARTBEAT_PARTS] for s in beat} == {len(beat)}
        named = list(itertools.chain.from_iterable(_runs(s) for s in beat))
        assert sorted(named) == sorted(ids) and len(named) == len(ids)  # each id once
        assert len({(s.start_time, s.end_time) for s in beat}) == 1  # one moment: one beat
    provider.shutdown()


def test_a_beat_that_fits_is_one_span_numbered_in_turn(fresh: None) -> None:
    provider = TracerProvider(shutdown_on_exit=False)
    heartbeat, finished = _beats(provider, max_span_bytes=4 * 1024 * 1024)
    heartbeat.emit(["run-a", "run-b"])
    heartbeat.emit(["run-a"])
    got = [
        (
            _runs(s),
            (s.attributes or {})[sc.SAGA_HEARTBEAT_BEAT],
            (s.attributes or {})[sc.SAGA_HEARTBEAT_PARTS],
        )
        for s in finished()
    ]
    assert got == [(["run-a", "run-b"], 1, 1), (["run-a"], 2, 1)]
    provider.shutdown()


def test_split_open_runs_keeps_the_order_and_each_part_within_its_room() -> None:
    runs = [f"r{i:04d}" for i in range(100)] + ["é" * 40, "\U0001f600" * 10, "x" * 300]
    room = 200
    parts = split_open_runs(runs, room)
    assert list(itertools.chain.from_iterable(parts)) == runs
    for part in parts:
        assert sum(string_item_bytes(r) for r in part) <= room or len(part) == 1
    assert parts[-1] == ["x" * 300]  # larger than the room on its own: a part of its own
    assert split_open_runs([], room) == [[]]


# --- a real sidecar ---------------------------------------------------------------------


def _tools() -> ToolRegistry:
    @tool("compensable", compensate="undo_x", compensate_args=lambda i: {"ref": i.result["ref"]})
    def do_x(n: int, idempotency_key: str) -> dict[str, str]:
        return {"ref": f"r{n}"}

    @tool("convergent")
    def undo_x(ref: str, idempotency_key: str) -> None:
        return None

    return ToolRegistry([do_x, undo_x])


def test_a_process_with_2000_open_runs_keeps_them_running_at_a_real_sidecar(
    fresh: None, sidecar_process: Callable[..., SidecarProcess], db_backend: str | None
) -> None:
    """manyopen's setting (the audit's repro): 2,000 open runs in one live process,
    max_span_bytes=65536. Twenty are real runs the sidecar knows; the rest are registered
    as each run registers itself on opening. While the process beats, they stay running."""
    sidecar = sidecar_process(db=db_backend)
    registry = CollectorRegistry()
    provider = TracerProvider(shutdown_on_exit=False)
    logger = json_lines_logger(io.StringIO())
    export = configure(
        sidecar.otlp,
        tracer_provider=provider,
        registry=registry,
        logger=logger,
        max_span_bytes=65536,
        heartbeat_interval=0.2,
    )
    saga = Saga("many", tools=_tools(), logger=logger, tracer_provider=provider)
    release = threading.Event()
    real: list[str] = []
    lock = threading.Lock()

    def hold(n: int) -> None:
        with saga.run_sync() as run:
            run.call("do_x", n=n)
            with lock:
                real.append(run.run_id)
            release.wait(60)

    def statuses() -> set[str | None]:
        views = [httpx.get(f"{sidecar.api}/runs/{r}", timeout=5) for r in real]
        return {v.json()["status"] if v.status_code == 200 else None for v in views}

    threads = [threading.Thread(target=hold, args=(n,)) for n in range(20)]
    extra = [str(uuid.uuid4()) for _ in range(2000 - len(threads))]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(real) == len(threads), what="the real runs open")
        wait_until(lambda: statuses() == {sc.STATE_RUNNING}, what="the runs at the sidecar")
        for run_id in extra:
            register_open_run(run_id)
        beats = export._heartbeat._beat
        # Thirty beats (6 s at 0.2 s): past any orphan window the sidecar may hold for this
        # instance (three intervals once it learned the cadence; 5 s + two before that).
        wait_until(lambda: export._heartbeat._beat >= beats + 30, what="thirty more beats")
        assert statuses() == {sc.STATE_RUNNING}
        too_large = registry.get_sample_value(sc.M_EXPORT_FAILURES, {"reason": "too_large"})
        assert not too_large
        release.set()
        for t in threads:
            t.join(30)
        assert export.force_flush(10.0)
        assert statuses() == {sc.STATUS_COMPLETED}
    finally:
        release.set()
        for t in threads:
            t.join(30)
        for run_id in extra:
            unregister_open_run(run_id)
        export.shutdown(timeout=2.0)
