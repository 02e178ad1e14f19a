"""What the adapters share (saga_otel/adapters/_declare.py), through each framework."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import function_tool, set_tracing_disabled
from langchain_core.tools import tool as langchain_tool

from saga_otel import RunStatus, configure, current_call, recover
from saga_otel._state import STATE
from saga_otel.adapters import Declare
from saga_otel.adapters import langchain as lc
from saga_otel.adapters import openai_agents as oa
from saga_otel.adapters import pydantic_ai as pa
from saga_otel.adapters._declare import DeclaredTools
from sidecar import Sidecar
from tests.sidecar.sidecar_testkit import FakeClock, export_http, open_run, settings_for


@pytest.fixture(autouse=True)
def no_sdk_tracing() -> Iterator[None]:
    set_tracing_disabled(True)  # the Agents SDK would export its traces to OpenAI
    yield


CREDIT_DECLARE = {
    "issue_credit": Declare(undo="reverse_credit", undo_args={"credit_id": "result.credit_id"}),
    "reverse_credit": Declare(step_class="convergent"),
}


def adapter_tools(
    adapter: str, functions: list[Callable[..., Any]], declare: dict[str, Declare]
) -> DeclaredTools[Any, Any]:
    """The functions as ``adapter``'s tools, in its SagaTools."""
    if adapter == "pydantic_ai":
        return pa.SagaTools(functions, declare)
    if adapter == "langchain":
        return lc.SagaTools([langchain_tool(f) for f in functions], declare)
    return oa.SagaTools([function_tool(f) for f in functions], declare)


ADAPTERS = ["pydantic_ai", "langchain", "openai_agents"]


@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_a_blocking_registry_recovers_a_dead_agents_run(tmp_path: Path, adapter: str) -> None:
    """recover() unwinds in sync code: the adapter's blocking registry runs each undo
    through the framework on a background loop, with the undo's own call context."""
    seen: list[tuple[str, str | None]] = []

    def issue_credit(order_id: int) -> dict[str, str]:
        """Credit the customer."""
        return {"credit_id": f"cr_{order_id}"}

    def reverse_credit(credit_id: str) -> str:
        """Reverse a credit."""
        call = current_call()
        seen.append((credit_id, call.idempotency_key if call is not None else None))
        return "reversed"

    tools = adapter_tools(adapter, [issue_credit, reverse_credit], CREDIT_DECLARE)
    clock = FakeClock()
    try:
        async with Sidecar(settings_for(tmp_path), clock=clock) as sidecar:
            api = f"http://127.0.0.1:{sidecar.api_port}"
            run = open_run(instance="agent-1")  # its stack: reverse_credit(credit_id=cr_1)
            await export_http(sidecar, run.spans())
            clock.now += sidecar.settings.idle_timeout + 1
            sidecar.tick()  # the agent is gone
            export = configure(f"http://127.0.0.1:{sidecar.otlp_http_port}")
            try:
                report = await asyncio.to_thread(
                    recover, run.run_id, tools=tools.blocking_registry(), sidecar=api
                )
            finally:
                await asyncio.to_thread(export.shutdown)
    finally:
        STATE.reset()
    assert report.status is RunStatus.COMPENSATED, report.compensations
    assert seen == [("cr_1", f"{run.run_id}:1:compensate")]
