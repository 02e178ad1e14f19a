"""The cost of one observed step (span, two log events, metrics) against a bare
OpenTelemetry SDK span with the same attributes, in the same process and run.

Both use one SDK TracerProvider with a no-op processor (what a real exporter
would queue is not this figure's concern). The observed step's log events are
rendered to JSON into a discarding stream, its metrics go to a private
registry: everything an agent pays per step, without I/O.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable

import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry

from bench._figures import Figure
from saga_otel import StepClass
from saga_otel import semconv as sc
from saga_otel._telemetry import Instrumentation

N = 5000
REPEATS = 7
GOAL = 1.3


def _logger() -> object:
    return structlog.wrap_logger(
        structlog.PrintLogger(io.StringIO()),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(20),
    )


def _batch(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    return (time.perf_counter() - t0) / N


def _paired(a: Callable[[], None], b: Callable[[], None]) -> tuple[float, float]:
    """Medians of alternating batches: both sides see the same machine moments."""
    xs, ys = [], []
    for _ in range(REPEATS):
        xs.append(_batch(a))
        ys.append(_batch(b))
    return statistics.median(xs), statistics.median(ys)


def run(progress: Callable[[str], None]) -> list[Figure]:
    provider = TracerProvider()
    instr = Instrumentation(
        "refund", tracer_provider=provider, registry=CollectorRegistry(), logger=_logger()
    )
    run_tel = instr.start_run()
    tracer = provider.get_tracer("bench")
    attrs = {
        sc.SAGA_RUN_ID: run_tel.run_id,
        sc.SAGA_NAME: "refund",
        sc.SAGA_CONTRACT_VERSION: 1,
        sc.SAGA_PHASE: "do",
        sc.SAGA_STEP_NAME: "issue_credit",
        sc.SAGA_STEP_INDEX: 1,
        sc.SAGA_STEP_ATTEMPT: 1,
        sc.SAGA_STEP_CLASS: "compensable",
        sc.SAGA_STEP_PIVOT: False,
        sc.GEN_AI_OPERATION_NAME: "execute_tool",
        sc.GEN_AI_TOOL_NAME: "issue_credit",
    }

    def bare() -> None:
        span = tracer.start_span("saga.do issue_credit", context=run_tel.context, attributes=attrs)
        span.set_status(Status(StatusCode.OK))
        span.end()

    def observed_step() -> None:
        with instr.attempt(
            run_tel,
            "do",
            "issue_credit",
            index=1,
            tool="issue_credit",
            step_class=StepClass.COMPENSABLE,
        ):
            pass

    for fn in (bare, observed_step):  # warm up both paths
        for _ in range(500):
            fn()
    progress(f"bare SDK span and observed step, alternating {REPEATS} x {N}")
    ref, val = _paired(bare, observed_step)
    progress("the same, the library's logger above info level (no log line rendered)")
    instr.log = structlog.wrap_logger(
        structlog.PrintLogger(io.StringIO()),
        wrapper_class=structlog.make_filtering_bound_logger(40),
    ).bind()
    ref_quiet, quiet = _paired(bare, observed_step)
    us = 1e6
    return [
        Figure(
            area="observe",
            name="observed step (span + JSON finish event + metrics)",
            value=val * us,
            unit="µs/step",
            reference_name="bare SDK span, same attributes",
            reference_value=ref * us,
            ratio=val / ref,
            goal=f"<= {GOAL}",
            met=val / ref <= GOAL,
            notes=(
                "Medians of 7 batches of 5,000 steps, alternating with the reference batch "
                "by batch "
                "in one process; no-op span processor. "
                "The library logs at info by default: the finish event is rendered, the start "
                "event (debug) is not. Most of the difference is structlog rendering that "
                "JSON line."
            ),
        ),
        Figure(
            area="observe",
            name="observed step, log events filtered out (level warning)",
            value=quiet * us,
            unit="µs/step",
            reference_name="bare SDK span, same attributes",
            reference_value=ref_quiet * us,
            ratio=quiet / ref_quiet,
            goal=f"<= {GOAL}",
            met=quiet / ref_quiet <= GOAL,
            notes="The same, with the library's logger above info level (span and metrics only).",
        ),
    ]
