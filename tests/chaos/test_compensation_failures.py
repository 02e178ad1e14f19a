"""Compensation failures at scale: transient ones are carried by retries,
permanent ones are escalated, never silent. Runs: SAGA_CHAOS_RUNS (10,000)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from saga_otel import EscalationCard, RetryPolicy, RunStatus, SagaReport, ToolRegistry, tool
from saga_otel.testing import FailureInjector, InjectedFailure, capture

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

RUNS = int(os.environ.get("SAGA_CHAOS_RUNS", "10000"))


def _tools(effects: list[tuple[str, int]]) -> ToolRegistry:
    tools: list[Any] = []
    for name in ("a", "b", "c", "d"):

        def do(ref: int, name: str = name) -> dict[str, int]:
            effects.append((f"do-{name}", ref))
            return {"ref": ref}

        def undo(ref: int, name: str = name) -> None:
            effects.append((f"undo-{name}", ref))

        tools.append(
            tool(
                "compensable",
                name=name,
                compensate=f"undo_{name}",
                compensate_args=lambda i: {"ref": i.result["ref"]},
            )(do)
        )
        tools.append(tool("convergent", name=f"undo_{name}")(undo))
    tools.append(tool("convergent", name="boom")(_boom))
    return ToolRegistry(tools)


def _boom() -> None:
    raise InjectedFailure("the step that makes the run unwind")


def test_transient_and_permanent_compensation_failures_at_scale(
    chaos_results: dict[str, Any],
) -> None:
    rng = random.Random(7)
    transient = FailureInjector(seed=11, rate=0.3, phases=("compensate",), transient_attempts=2)
    effects: list[tuple[str, int]] = []
    base = _tools(effects)
    cap = capture()
    escalated: list[EscalationCard] = []
    policy = RetryPolicy(attempts=4, jitter=0)
    tally = {"compensated": 0, "compensation_failed": 0, "completed": 0}
    for n in range(RUNS):
        broken = rng.choice("abcd") if rng.random() < 0.1 else None
        injector = transient
        if broken is not None:  # this undo fails for good
            injector = FailureInjector(seed=n).fail(f"undo_{broken}", phase="compensate")
        saga = cap.saga(
            "chaos",
            tools=injector.wrap(base),
            retry=policy,
            escalation_handlers=[lambda card, report: escalated.append(card)],
        )
        plan = [rng.choice("abcd") for _ in range(rng.randint(1, 4))]
        fails = rng.random() < 0.8
        run = saga.run_sync()
        try:
            with run:
                for i, name in enumerate(plan):
                    run.call(name, ref=i)
                if fails:
                    run.call("boom")
        except InjectedFailure:
            pass
        report: SagaReport | None = run.report
        assert report is not None
        tally[report.status.value] += 1
        if not fails:
            assert report.status is RunStatus.COMPLETED
        elif broken is not None and broken in plan:
            assert report.status is RunStatus.COMPENSATION_FAILED
            assert escalated and escalated[-1].run_id == report.run_id  # escalated, loudly
            assert len(escalated[-1].not_undone) == len(report.compensations_failed)
        else:
            # Transient failures (up to 2 per undo, 4 attempts) never leave anything undone.
            assert report.status is RunStatus.COMPENSATED, report.compensations_failed
            assert len(report.compensations) == len(plan)
        if n % 500 == 0:
            cap.clear()
    assert len(transient.injected) > RUNS * 0.3  # the injector really fired, at scale
    assert tally["compensation_failed"] > 0 and tally["compensated"] > 0
    failed_runs = cap.metric("saga_runs_finished_total", saga="chaos", status="compensation_failed")
    assert failed_runs == tally["compensation_failed"] == len(escalated)
    chaos_results["compensation_failures"] = {
        "runs": RUNS,
        "transient_failures_injected": len(transient.injected),
        "transient_rate": 0.3,
        "silent_failures": 0,
        **{f"ended_{k}": v for k, v in tally.items()},
        "escalated": len(escalated),
    }
