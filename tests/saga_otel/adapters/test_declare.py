"""What the adapters share (saga_otel/adapters/_declare.py), through each framework."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import mcp.types as mt
import pytest
from agents import function_tool, set_tracing_disabled
from langchain_core.tools import tool as langchain_tool
from pydantic import BaseModel

from saga_otel import (
    CallInfo,
    ConfigurationError,
    RunStatus,
    StepClass,
    configure,
    current_call,
    recover,
)
from saga_otel._state import STATE
from saga_otel.adapters import Declare
from saga_otel.adapters import langchain as lc
from saga_otel.adapters import openai_agents as oa
from saga_otel.adapters import pydantic_ai as pa
from saga_otel.adapters._declare import (
    DeclaredTools,
    Described,
    lookup,
    map_declared,
    refusal,
    review,
    undo_recipe,
)
from saga_otel.adapters.mcp import load_tools
from saga_otel.testing import Captured, capture
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


@pytest.fixture
def cap() -> Captured:
    return capture()


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


@dataclasses.dataclass
class CreditRecord:
    credit_id: str
    amount: int


class CreditModel(BaseModel):
    credit_id: str
    amount: int


class CreditTuple(NamedTuple):
    credit_id: str
    amount: int


@pytest.mark.parametrize(
    "result",
    [CreditRecord("cr_1", 5), CreditModel(credit_id="cr_1", amount=5), CreditTuple("cr_1", 5)],
    ids=["dataclass", "pydantic", "namedtuple"],
)
def test_undo_paths_and_names_read_the_fields_of_a_returned_object(result: Any) -> None:
    """A tool returning a model or a dataclass (the model reads it as JSON) keeps its undo:
    "result.credit_id" reads the field, and so does filling the undo's parameters by name."""
    info = CallInfo("issue_credit", {"order_id": 1}, result)
    by_path = undo_recipe({"credit_id": "result.credit_id", "n": "result.amount"}, ["credit_id"])
    assert by_path(info) == {"credit_id": "cr_1", "n": 5}
    by_name = undo_recipe(None, ["credit_id", "order_id"])
    assert by_name(info) == {"credit_id": "cr_1", "order_id": 1}


def test_an_undo_path_not_in_the_result_names_the_path_the_type_and_the_fix() -> None:
    info = CallInfo("issue_credit", {}, CreditModel(credit_id="cr_1", amount=5))
    for path, part in (("result.id", "'id'"), ("result.model_dump", "'model_dump'")):
        with pytest.raises(ConfigurationError) as told:
            lookup(info, path)
        text = str(told.value)
        assert f"{path!r}: {part} is not in the CreditModel" in text
        assert "a field of a model or dataclass" in text
    with pytest.raises(ConfigurationError, match=r"'result.items.3': '3' is not in the list"):
        lookup(CallInfo("t", {}, {"items": [1]}), "result.items.3")


async def test_a_tool_returning_a_model_is_undone_through_its_field(cap: Captured) -> None:
    undone: list[str] = []

    def issue_credit(order_id: int) -> CreditModel:
        """Credit the customer."""
        return CreditModel(credit_id=f"cr_{order_id}", amount=5)

    def reverse_credit(credit_id: str) -> str:
        """Reverse a credit."""
        undone.append(credit_id)
        return "reversed"

    tools = adapter_tools("pydantic_ai", [issue_credit, reverse_credit], CREDIT_DECLARE)
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(RuntimeError, match="the reply failed"):
        async with run:
            await run.call("issue_credit", order_id=4921)
            raise RuntimeError("the reply failed")
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert undone == ["cr_4921"]


class _CreditServer:
    """An MCP session whose tools answer in text content: the result is a CallToolResult."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any] | None]] = []

    async def list_tools(self) -> mt.ListToolsResult:
        def schema(**props: str) -> dict[str, Any]:
            return {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}}

        writes = mt.ToolAnnotations(destructive_hint=False, idempotent_hint=True)
        return mt.ListToolsResult(
            tools=[
                mt.Tool(name="issue_credit", input_schema=schema(amount="integer"),
                        annotations=mt.ToolAnnotations(destructive_hint=False)),
                mt.Tool(name="reverse_credit", input_schema=schema(credit_id="string"),
                        annotations=writes),
            ]
        )  # fmt: skip

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None
    ) -> mt.CallToolResult:
        self.calls.append((name, arguments))
        text = json.dumps({"credit_id": "cr_1"})
        return mt.CallToolResult(content=[mt.TextContent(type="text", text=text)])


async def test_a_describe_template_sees_the_decoded_result_as_a_function_does(
    cap: Captured,
) -> None:
    server = _CreditServer()
    undo = {"credit_id": "result.credit_id"}
    declare = {
        "issue_credit": Declare(
            undo="reverse_credit",
            undo_args=undo,
            describe="reverse {result[credit_id]} ({credit_id})",
        )
    }
    tools = await load_tools(server, declare)
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(RuntimeError, match="the reply failed"):
        async with run:
            await tools.bind(run).call_tool("issue_credit", {"amount": 5})
            (pushed,) = run.stack
            raise RuntimeError("the reply failed")
    assert pushed.description == "reverse cr_1 (cr_1)"
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert server.calls == [
        ("issue_credit", {"amount": 5}),
        ("reverse_credit", {"credit_id": "cr_1"}),
    ]


async def test_a_describe_template_that_fails_keeps_the_undo(cap: Captured) -> None:
    server = _CreditServer()
    declare = {
        "issue_credit": Declare(
            undo="reverse_credit",
            undo_args={"credit_id": "result.credit_id"},
            describe="reverse {result[credit_id][0][x]}",
        )
    }
    tools = await load_tools(server, declare)
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(RuntimeError, match="the reply failed"):
        async with run:
            await tools.bind(run).call_tool("issue_credit", {"amount": 5})
            (pushed,) = run.stack
            raise RuntimeError("the reply failed")
    assert pushed.description.startswith(
        "reverse {result[credit_id][0][x]} (description not built: TypeError: "
    )
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_two_tools_with_one_name_are_refused(adapter: str) -> None:
    """One would be dropped silently, its declaration applied to the other."""

    def lookup(order_id: int) -> str:
        """Read an order."""
        return "read"

    def delete(order_id: int) -> str:
        """Delete an order."""
        return "deleted"

    delete.__name__ = "lookup"
    with pytest.raises(Exception, match="lookup") as told:
        adapter_tools(adapter, [lookup, delete], {"lookup": Declare(step_class="read")})
    if adapter != "pydantic_ai":  # pydantic-ai's FunctionToolset refuses it itself
        assert isinstance(told.value, ConfigurationError)
        assert str(told.value) == (
            "two tools are named 'lookup': the model tells tools apart by name, so one would "
            "be dropped; give each its own name"
        )


def test_the_review_shows_control_characters_in_names_as_escapes() -> None:
    """A server's tool name with an escape sequence (SGR 8 hides what follows) or a
    newline must not hide or break its row on the reviewer's terminal."""
    rows = map_declared(
        [
            Described("get_order", StepClass.READ),
            Described("delete_all\x1b[8m", StepClass.IRREVERSIBLE, True, "destructive=y"),
            Described("two\nlines\u202e"),
        ],
        unannotated="irreversible",
    )
    lines = review(rows).splitlines()
    assert len(lines) == 4
    assert lines[2].split() == [
        "delete_all\\x1b[8m", "irreversible", "yes", "annotations", "destructive=y", "-"
    ]  # fmt: skip
    assert lines[3].startswith("two\\x0alines\\u202e  irreversible  yes")
    refused = refusal(map_declared([Described("x\x1b[2J")]))
    assert refused is not None and "x\\x1b[2J" in refused and "\x1b" not in refused
