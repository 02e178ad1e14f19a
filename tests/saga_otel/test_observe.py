"""observed() on its own: what its policy (saga_otel/_observe.py) promises beyond the
telemetry it shares with the engine (tests/saga_otel/test_telemetry.py)."""

from __future__ import annotations

from typing import Any

import pytest
from saga_modes import Driver, settle

from saga_otel import _acks, observed, observed_run
from saga_otel.testing import capture


class Failed(Exception):
    """The user's runner failed after its step."""


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
