"""saga_otel.testing's helpers fail loudly when given a name that would make them pass anyway,
and contract_violations checks the saga spans among your own."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from saga_otel import ConfigurationError, RunStatus, ToolRegistry, tool
from saga_otel.testing import (
    Captured,
    FailureInjector,
    capture,
    contract_violations,
    metric_value,
)


@tool("compensable", compensate="reverse_credit", compensate_args=lambda i: {"credit_id": i.result})
def issue_credit() -> str:
    return "cr_1"


@tool("convergent")
def reverse_credit(credit_id: str) -> None:
    return None


@tool("irreversible")
def send_reply() -> None:
    raise RuntimeError("mail down")


def refund(cap: Captured, tools: ToolRegistry) -> RunStatus:
    """issue_credit, then send_reply fails: the credit's undo runs."""
    run = cap.saga("refund", tools=tools).run_sync()
    with pytest.raises(RuntimeError, match="mail down"), run:
        run.call("issue_credit")
        run.call("send_reply")
    assert run.report is not None
    return run.report.status


def registry() -> ToolRegistry:
    return ToolRegistry([issue_credit, reverse_credit, send_reply])


def test_a_failure_plan_that_would_never_inject_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"phase 'undo'; use 'do' or 'compensate'"):
        FailureInjector().fail("reverse_credit", phase="undo")
    with pytest.raises(ConfigurationError, match=r"times=0\) never injects"):
        FailureInjector().fail("reverse_credit", times=0)
    with pytest.raises(ConfigurationError, match=r"phases=\('do', 'undo'\)\): .* 'undo'"):
        FailureInjector(phases=("do", "undo"))
    with pytest.raises(ConfigurationError, match=r"rate=30\) is not a share of calls"):
        FailureInjector(rate=30)
    # A random plan too: one that draws calls but fails none of their attempts, or no phase.
    for attempts in (0, -1):
        with pytest.raises(
            ConfigurationError,
            match=rf"\(rate=0.5, transient_attempts={attempts}\) never injects: use "
            r"transient_attempts >= 1 .*, or rate=0.0",
        ):
            FailureInjector(seed=1, rate=0.5, transient_attempts=attempts)
    with pytest.raises(
        ConfigurationError,
        match=r"\(rate=0.5, phases=\(\)\) never injects: name the phases to fail in "
        r"\('do' and/or 'compensate'\), or use rate=0.0",
    ):
        FailureInjector(rate=0.5, phases=())
    FailureInjector(phases=(), transient_attempts=0)  # no rate: no random plan to refuse
    # A tool name is checked when the registry is known: at wrap(), and at fail() after it.
    typo = FailureInjector().fail("reverse_credt", phase="compensate")
    with pytest.raises(
        ConfigurationError,
        match=r"names 'reverse_credt', which no registry it wraps holds "
        r"\(tools: issue_credit, reverse_credit, send_reply\)",
    ):
        typo.wrap(registry())
    injector = FailureInjector()
    tools = injector.wrap(registry())
    with pytest.raises(ConfigurationError, match="names 'send_replies'"):
        injector.fail("send_replies")
    # A plan that holds injects, as before.
    injector.fail("reverse_credit", phase="compensate")
    assert refund(capture(), tools) is RunStatus.COMPENSATION_FAILED
    assert {(tool, phase) for _, tool, phase, _ in injector.injected} == {
        ("reverse_credit", "compensate")
    }


def test_metric_value_refuses_a_name_or_labels_the_metric_lacks() -> None:
    cap = capture()
    tools = FailureInjector().fail("reverse_credit", phase="compensate").wrap(registry())
    assert refund(cap, tools) is RunStatus.COMPENSATION_FAILED
    failures = "saga_compensation_failures_total"
    assert cap.metric(failures, saga="refund", step="issue_credit") == 1
    assert cap.metric(failures, saga="refund", step="send_reply") == 0.0  # no such series yet
    with pytest.raises(
        ConfigurationError,
        match=r"no metric sample 'saga_compensation_failures' in this registry \(a counter's "
        r"name ends in _total\); its samples: saga_compensation_failures_total, ",
    ):
        cap.metric("saga_compensation_failures", saga="refund", step="issue_credit")
    for labels in ({"saga": "refund", "tool": "reverse_credit"}, {"saga": "refund"}):
        with pytest.raises(
            ConfigurationError,
            match=rf"'{failures}' has labels \(saga, step\), not \({', '.join(sorted(labels))}\)",
        ):
            cap.metric(failures, **labels)
    # A metric with no series yet is checked too, by the label names it was made with.
    assert cap.metric("saga_stuck_runs_total", saga="refund") == 0.0
    with pytest.raises(ConfigurationError, match=r"has labels \(saga\), not \(saga_name\)"):
        cap.metric("saga_stuck_runs_total", saga_name="refund")
    # A histogram's buckets carry le besides the metric's labels.
    bucket = {"saga": "refund", "step": "issue_credit", "phase": "do"}
    assert cap.metric("saga_step_duration_seconds_bucket", **bucket, le="+Inf") == 1
    with pytest.raises(ConfigurationError, match=r"has labels \(le, phase, saga, step\)"):
        cap.metric("saga_step_duration_seconds_bucket", **bucket)
    with pytest.raises(ConfigurationError, match=r"its samples: none yet"):
        metric_value(CollectorRegistry(), failures, saga="refund", step="issue_credit")


def test_contract_violations_skips_your_own_spans_but_not_a_saga_span_without_its_phase() -> None:
    cap = capture()
    tracer = cap.provider.get_tracer("my-agent")
    with tracer.start_as_current_span("agent.turn", attributes={"user.id": "u1"}):
        assert refund(cap, registry()) is RunStatus.COMPENSATED
    assert contract_violations(cap.spans()) == []
    # The sidecar ignores a span without saga.phase: one meant as a saga span is reported.
    cap.clear()
    tracer.start_span("saga.do issue_credit").end()
    tracer.start_span("my.step", attributes={"saga.run.id": "r1"}).end()
    tracer.start_span("saga.dossier").end()  # a name that only begins like one: skipped
    assert contract_violations(cap.spans()) == [
        f"span {name!r}: saga.phase=<missing>: use one of compensate, do, escalate, heartbeat, "
        "run, unwind, validate"
        for name in ("saga.do issue_credit", "my.step")
    ]


def test_captured_spans_refuses_a_phase_no_saga_span_has() -> None:
    cap = capture()
    assert refund(cap, registry()) is RunStatus.COMPENSATED
    assert len(cap.spans("compensate")) == 1
    with pytest.raises(
        ConfigurationError,
        match=r"Captured.spans\(phase='compensation'\): no saga span has that phase; use one "
        r"of compensate, do, escalate, heartbeat, run, unwind, validate",
    ):
        cap.spans("compensation")
    assert cap.spans("escalate") == []  # a real phase with no span: an empty list, as before
