"""observed() on its own: what its policy (saga_otel/_observe.py) promises beyond the
telemetry it shares with the engine (tests/saga_otel/test_telemetry.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from saga_modes import Driver, settle

from saga_otel import _acks, observed, observed_run
from saga_otel import semconv as sc
from saga_otel.testing import Captured, capture
from sidecar import RunState
from sidecar._otlp import extract


class Failed(Exception):
    """The user's runner failed after its step."""


class Refused(Exception):
    """The ledger refused to reverse a credit."""


async def test_an_observed_compensate_waits_for_the_ack_of_its_span(
    mode: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the engine's undo: a successful compensate returns only once the sidecar
    acknowledged its ended span, so a recovery elsewhere never repeats it (the do and the
    unwind were waited for; the compensate was not)."""
    log: list[str] = []

    def ack(span: Any) -> bool:
        log.append(f"ack {span.name}" + ("" if span.end_time is not None else " (not ended)"))
        return True

    async def ack_async(span: Any) -> bool:
        return ack(span)

    monkeypatch.setattr(_acks, "wait_for_ack", ack)
    monkeypatch.setattr(_acks, "wait_for_ack_async", ack_async)

    class Hold:
        def __init__(self) -> None:
            self.do = mode.fn(lambda n: log.append("do") or n)
            self.compensate = mode.fn(lambda: log.append("compensate"))

    cap = capture()
    kw: dict[str, Any] = {"saga": "obs", "tracer_provider": cap.provider}
    kw.update(registry=cap.registry, logger=cap.logger)
    step = observed(Hold(), step="hold", compensation=lambda i: {"hold": i.result}, **kw)
    with pytest.raises(Failed), observed_run(**kw):
        await settle(step.do(1))
        log.append("next step")
        try:
            raise Failed("the runner failed")
        except Failed:
            await settle(step.compensate())
            log.append("compensate returned")
            raise
    assert log == [
        "do",
        "ack saga.do hold",
        "next step",
        "ack saga.unwind obs",
        "compensate",
        "ack saga.compensate hold",
        "compensate returned",
    ]


async def test_an_observed_step_raising_stop_iteration_reaches_the_caller_as_itself(
    mode: Driver,
) -> None:
    """observed()'s policy is a generator too (PEP 479 made a StopIteration a
    RuntimeError): a sync step's caller gets its own object. An async step is a
    coroutine, which Python never lets raise StopIteration: its caller gets Python's
    RuntimeError with the object as its __cause__, with or without observed()."""
    raised = StopIteration("no matching order")

    def find_order() -> None:
        raise raised

    cap = capture()
    kw: dict[str, Any] = {"saga": "obs", "tracer_provider": cap.provider}
    kw.update(registry=cap.registry, logger=cap.logger)
    wrapped = observed(mode.fn(find_order), step="find_order", **kw)
    with pytest.raises(BaseException) as info:
        await settle(wrapped())
    if mode.is_async:
        assert type(info.value) is RuntimeError and info.value.__cause__ is raised
    else:
        assert info.value is raised and info.value.__context__ is None


class Credits:
    """The user's issue_credit step, called once per credit: ``do(credit_id)`` issues
    it; ``compensate(credit)`` reverses it, refusing the ids in ``refuse`` (each
    refusal used once)."""

    def __init__(self, mode: Driver, refuse: Sequence[str] = ()) -> None:
        self.refuse, self.undone = list(refuse), list[str]()
        self.do = mode.fn(lambda credit_id: {"credit_id": credit_id})
        self.compensate = mode.fn(self._reverse)

    def _reverse(self, credit: dict[str, str]) -> None:
        if credit["credit_id"] in self.refuse:
            self.refuse.remove(credit["credit_id"])
            raise Refused(f"ledger refused reversal of {credit['credit_id']}")
        self.undone.append(credit["credit_id"])


def credit_step(cap: Captured, credits: Credits) -> tuple[dict[str, Any], Any]:
    """The run's keywords (``cap``'s telemetry) and ``credits`` as an observed step whose
    undo takes the credit id its do returned."""
    kw: dict[str, Any] = {"saga": "obs", "tracer_provider": cap.provider}
    kw.update(registry=cap.registry, logger=cap.logger)
    step = observed(
        credits,
        step="issue_credit",
        compensation=lambda info: {"credit_id": info.result["credit_id"]},
        **kw,
    )
    return kw, step


async def unwind_credits(
    cap: Captured, credits: Credits, issue: Sequence[str], undo: Sequence[str]
) -> str:
    """The user's runner: issues the credits in ``issue`` through one observed step,
    fails, and reverses the credits in ``undo`` in that order (a refused reversal is
    left for later, and the next one runs); returns the run id."""
    kw, step = credit_step(cap, credits)
    with pytest.raises(Failed), observed_run(**kw) as run:
        issued = {c: await settle(step.do(c)) for c in issue}
        try:
            raise Failed("the reply failed")
        except Failed:
            for credit_id in undo:
                with contextlib.suppress(Refused):
                    await settle(step.compensate(issued[credit_id]))
            raise
    return run.run_id


def compensates(cap: Captured) -> list[tuple[int, bool, dict[str, Any]]]:
    """Each compensate span: the index it says it undid, OK or not, and its arguments."""
    return [
        (
            s.attributes[sc.SAGA_STEP_INDEX],
            s.status.is_ok,
            json.loads(s.attributes[sc.SAGA_COMPENSATION_ARGS]),
        )
        for s in cap.spans(sc.PHASE_COMPENSATE)
        if s.attributes is not None
    ]


def card(cap: Captured) -> dict[str, Any] | None:
    """The library's escalation card, if the run escalated."""
    spans = cap.spans(sc.PHASE_ESCALATE)
    attrs = spans[0].attributes if spans else None
    return json.loads(attrs[sc.SAGA_ESCALATION_CARD]) if attrs else None


def sidecar_view(cap: Captured, run_id: str) -> Any:
    """The run as the sidecar rebuilds it from these spans."""
    state = RunState()
    state.apply(extract(encode_spans(cap.spans())).spans, time.time())
    view = state.view(run_id)
    assert view is not None
    return view


def stack(view: Any) -> list[tuple[int, str]]:
    return [(c["index"], c["args"]["credit_id"]) for c in view["stack"]]


async def test_a_repeated_step_undoes_each_call_at_its_own_index(mode: Driver) -> None:
    """A step called twice (cr1 at index 0, cr2 at index 1) unwound in reverse, cr2's
    undo failing: each compensate span names the call it undid (matched by the undo's
    arguments), so the card and the sidecar's stack say cr2 stands, not cr1 (every
    compensate went to the step's last index: undo cr1 again, cr2 never mentioned)."""
    cap, credits = capture(), Credits(mode, refuse=["cr2"])
    run_id = await unwind_credits(cap, credits, ["cr1", "cr2"], ["cr2", "cr1"])
    assert credits.undone == ["cr1"]
    assert compensates(cap) == [
        (1, False, {"credit_id": "cr2"}),
        (0, True, {"credit_id": "cr1"}),
    ]
    escalation = card(cap)
    assert escalation is not None
    assert [(d["index"], d["args"]) for d in escalation["not_undone"]] == [
        (1, {"credit_id": "cr2"})
    ]
    view = sidecar_view(cap, run_id)
    assert view["status"] == sc.STATUS_COMPENSATION_FAILED
    assert stack(view) == [(1, "cr2")]


async def test_a_repeated_step_undone_in_full_leaves_an_empty_stack(mode: Driver) -> None:
    """Both calls undone: the run ends compensated and nothing is left on the sidecar's
    stack (cr1's undo stayed listed, both compensates having named index 1)."""
    cap, credits = capture(), Credits(mode)
    run_id = await unwind_credits(cap, credits, ["cr1", "cr2"], ["cr2", "cr1"])
    assert [(i, ok) for i, ok, _ in compensates(cap)] == [(1, True), (0, True)]
    assert card(cap) is None
    view = sidecar_view(cap, run_id)
    assert view["status"] == sc.STATUS_COMPENSATED and view["escalation"] is None
    assert stack(view) == []


async def test_two_identical_calls_undone_once_leave_exactly_one(mode: Driver) -> None:
    """The same arguments twice (crX at 0 and 1), then crY at 2: one undo of crX takes
    the latest crX (its failed first attempt stays owed, so the retry lands there too)
    and leaves the other crX and crY (it went to the step's last index, crY's)."""
    cap, credits = capture(), Credits(mode, refuse=["crX"])
    run_id = await unwind_credits(cap, credits, ["crX", "crX", "crY"], ["crX", "crX"])
    assert credits.undone == ["crX"]
    assert [(i, ok) for i, ok, _ in compensates(cap)] == [(1, False), (1, True)]
    escalation = card(cap)  # the refused attempt: compensation_failed, escalated
    assert escalation is not None
    assert sorted((d["index"], d["args"]["credit_id"]) for d in escalation["not_undone"]) == [
        (0, "crX"),
        (2, "crY"),
    ]
    assert stack(sidecar_view(cap, run_id)) == [(2, "crY"), (0, "crX")]


async def test_with_nothing_to_match_a_repeated_step_is_undone_latest_first(
    mode: Driver,
) -> None:
    """No compensation recipe (every stored undo has no arguments) and the runner's own
    context as the undo's argument: the undos take the calls latest first, the unwind's
    order, and the run ends with nothing left (both went to the last index)."""
    cap = capture()
    kw: dict[str, Any] = {"saga": "obs", "tracer_provider": cap.provider}
    kw.update(registry=cap.registry, logger=cap.logger)

    class Hold:
        def __init__(self) -> None:
            self.do = mode.fn(lambda ctx: None)
            self.compensate = mode.fn(lambda ctx: None)

    step = observed(Hold(), step="hold", **kw)
    with pytest.raises(Failed), observed_run(**kw) as run:
        for n in (1, 2):
            await settle(step.do({"n": n}))
        try:
            raise Failed("the runner failed")
        except Failed:
            for n in (2, 1):
                await settle(step.compensate({"n": n}))
            raise
    assert [s.attributes[sc.SAGA_STEP_INDEX] for s in cap.spans(sc.PHASE_COMPENSATE)] == [1, 0]
    assert sidecar_view(cap, run.run_id)["stack"] == []


async def test_a_run_left_with_undos_owed_ends_compensation_failed_not_compensated(
    mode: Driver,
) -> None:
    """The runner undid cr2 and stopped: cr1 stands. "compensated" would tell a person
    and the sidecar that everything was undone; the run escalates cr1 instead."""
    cap, credits = capture(), Credits(mode)
    run_id = await unwind_credits(cap, credits, ["cr1", "cr2"], ["cr2"])
    assert credits.undone == ["cr2"]
    escalation = card(cap)
    assert escalation is not None and escalation["reason"] == sc.STATUS_COMPENSATION_FAILED
    assert [(d["index"], d["args"]) for d in escalation["not_undone"]] == [
        (0, {"credit_id": "cr1"})
    ]
    view = sidecar_view(cap, run_id)
    assert view["status"] == sc.STATUS_COMPENSATION_FAILED and stack(view) == [(0, "cr1")]


class Cancelled(BaseException):
    """What a runner catching only Exception lets through (a cancellation, Ctrl-C)."""


async def test_a_run_cancelled_before_its_runner_undid_anything_escalates(mode: Driver) -> None:
    cap, credits = capture(), Credits(mode)
    kw, step = credit_step(cap, credits)
    with pytest.raises(Cancelled), observed_run(**kw) as run:
        await settle(step.do("cr1"))
        raise Cancelled  # while the agent waits on the model: no undo ran
    assert credits.undone == []
    escalation = card(cap)
    assert escalation is not None and escalation["reason"] == sc.STATUS_COMPENSATION_FAILED
    assert sidecar_view(cap, run.run_id)["status"] == sc.STATUS_COMPENSATION_FAILED


async def test_gathered_undos_of_a_repeated_step_take_one_call_each() -> None:
    """Two undos of the same step with the same arguments run at once (asyncio.gather):
    the first claims its call while it runs, so the second takes the other one (both
    went to the latest and the other stayed on the stack)."""
    cap = capture()
    kw: dict[str, Any] = {"saga": "obs", "tracer_provider": cap.provider}
    kw.update(registry=cap.registry, logger=cap.logger)

    class Hold:
        async def do(self, credit_id: str) -> dict[str, str]:
            return {"credit_id": credit_id}

        async def compensate(self, credit: dict[str, str]) -> None:
            await asyncio.sleep(0)  # both undos are under way at once

    step = observed(Hold(), step="hold", compensation=lambda info: info.result, **kw)
    with pytest.raises(Failed), observed_run(**kw) as run:
        done = [await step.do("crX"), await step.do("crX")]
        try:
            raise Failed("the runner failed")
        except Failed:
            await asyncio.gather(*(step.compensate(c) for c in done))
            raise
    indexes = [s.attributes[sc.SAGA_STEP_INDEX] for s in cap.spans(sc.PHASE_COMPENSATE)]
    assert sorted(indexes) == [0, 1]
    assert sidecar_view(cap, run.run_id)["stack"] == []
