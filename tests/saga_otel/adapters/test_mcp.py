"""The MCP adapter against a real MCP server (MCPServer, in process over memory streams).

The annotation table is checked over every combination of hints; the refund story
runs end to end through the server's tools, its unwind in reverse through them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

import mcp.types as mt
import pytest
from mcp import Client
from mcp.server import Server
from mcp.server.mcpserver import MCPServer

from examples.mcp_refund_agent import DECLARE, SCRIPT
from examples.mcp_refund_server import refund_server
from examples.world import World
from saga_otel import ConfigurationError, RunStatus, StepClass
from saga_otel import semconv as sc
from saga_otel.adapters import mcp as mcp_adapter
from saga_otel.adapters.mcp import (
    Declare,
    McpToolError,
    classify,
    decode_result,
    load_tools,
    map_tools,
    review,
)
from saga_otel.testing import Captured, capture, contract_violations, span_attrs

HINTS = (None, True, False)


def _tool(name: str, ann: mt.ToolAnnotations | None = None, **props: Any) -> mt.Tool:
    schema = {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}}
    return mt.Tool(name=name, input_schema=schema, annotations=ann)


def _expected(ro: bool | None, de: bool | None, idem: bool | None, ow: bool | None) -> Any:
    """MCP's own words: readOnly default false, destructive default true, idempotent false."""
    if (ro, de, idem, ow) == (None, None, None, None):
        return None
    if ro is True:
        return StepClass.READ
    destructive = de is not False
    if not destructive and idem is True:
        return StepClass.CONVERGENT
    return StepClass.IRREVERSIBLE


@pytest.mark.parametrize(("ro", "de", "idem", "ow"), list(itertools.product(HINTS, repeat=4)))
def test_every_combination_of_hints(
    ro: bool | None, de: bool | None, idem: bool | None, ow: bool | None
) -> None:
    ann = mt.ToolAnnotations(
        read_only_hint=ro, destructive_hint=de, idempotent_hint=idem, open_world_hint=ow
    )
    expected = _expected(ro, de, idem, ow)
    assert classify(ann) == expected
    tools = [_tool("t", ann), _tool("undo_t", mt.ToolAnnotations(read_only_hint=False))]
    (row, _) = map_tools(tools, unannotated="irreversible")
    assert row.step_class == (expected or StepClass.IRREVERSIBLE)
    assert row.is_pivot == (row.step_class is StepClass.IRREVERSIBLE)
    # A destructive tool (the server says so, or MCP's default does) without an
    # undo maps to irreversible and nothing else, whatever the user declares.
    destructive = expected is not None and ro is not True and de is not False
    for cls in (StepClass.READ, StepClass.CONVERGENT, StepClass.IRREVERSIBLE):
        declared = {"t": Declare(step_class=cls)}
        if destructive and cls is not StepClass.IRREVERSIBLE:
            with pytest.raises(
                ConfigurationError, match=r"destructive .* can only be irreversible"
            ):
                map_tools(tools, declared)
        else:
            assert map_tools(tools, declared)[0].step_class is cls
    # With an undo any tool may be compensable: its write is no longer a pivot.
    (row, _) = map_tools(tools, {"t": Declare(undo="undo_t")})
    assert row.step_class is StepClass.COMPENSABLE and not row.is_pivot


def test_no_annotations_is_unclassified_and_refused_with_the_list() -> None:
    assert classify(None) is None
    tools = [_tool("a"), _tool("b", mt.ToolAnnotations(title="B only")), _tool("c", None)]
    rows = map_tools(tools, {"c": Declare(step_class="convergent")})
    assert [r.step_class for r in rows] == [None, None, StepClass.CONVERGENT]
    assert "UNCLASSIFIED" in review(rows)


async def test_load_refuses_unclassified_tools_naming_each() -> None:
    server = MCPServer("bare")

    @server.tool()
    def ping() -> str:
        return "pong"

    @server.tool()
    def wipe(path: str) -> str:
        return path

    async with Client(server) as bare:
        with pytest.raises(ConfigurationError) as err:
            await load_tools(bare.session)
        msg = str(err.value)
        assert "ping, wipe" in msg and "unannotated='irreversible'" in msg
        tools = await load_tools(bare.session, unannotated="irreversible")
        assert {r.name: r.source for r in tools.mappings} == {"ping": "default", "wipe": "default"}
        assert tools.registry.get("ping").step_class is StepClass.IRREVERSIBLE
        declared = {"ping": Declare(step_class="read")}
        with pytest.raises(ConfigurationError, match=r"no declaration\): wipe\."):
            await load_tools(bare.session, declared)
        declared["wipe"] = Declare(step_class="irreversible")
        tools = await load_tools(bare.session, declared)
        assert tools.registry.get("ping").step_class is StepClass.READ


@pytest.mark.parametrize(
    ("declare", "match"),
    [
        ({"nope": Declare(step_class="read")}, "does not offer: nope"),
        ({"issue_credit": Declare(undo="nope")}, "names 'nope' as its undo"),
        ({"set_ticket_status": Declare(undo="set_ticket_status", snapshot="x")}, "snapshot"),
        ({"get_order": Declare(snapshot="get_ticket")}, "snapshot but no undo"),
        ({"issue_credit": Declare(step_class="compensable")}, "names no undo"),
        ({"issue_credit": Declare(step_class="read", undo="reverse_credit")}, "keeps no undo"),
        (
            {"issue_credit": Declare(undo="reverse_credit", undo_args={"credit_id": "id"})},
            "start it with result., args. or snapshot",
        ),
        ({"send_reply": Declare(step_class="convergent")}, "destructive"),
    ],
)
async def test_declarations_that_cannot_hold_are_refused(
    declare: dict[str, Declare], match: str
) -> None:
    # (An async fixture cannot hold the client: anyio scopes must exit in the task they entered.)
    async with Client(refund_server(World())) as client:
        with pytest.raises(ConfigurationError, match=match):
            await load_tools(client.session, declare)


@pytest.fixture
def world() -> World:
    return World(mail_down=True)


@pytest.fixture
def cap() -> Captured:
    return capture()


def test_review_shows_class_pivot_and_undo() -> None:
    async def go() -> str:
        async with Client(refund_server(World())) as c:
            return (await load_tools(c.session, DECLARE)).review()

    text = asyncio.run(go())
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "compensable" in lines["issue_credit"]
    assert "reverse_credit(credit_id=result.credit_id)" in lines["issue_credit"]
    assert "reversible" in lines["set_ticket_status"] and "snapshot get_ticket" in text
    assert "irreversible  yes" in lines["send_reply"]
    assert "convergent" in lines["reverse_credit"] and "read" in lines["get_order"]


async def test_refund_story_unwinds_in_reverse_through_the_mcp_tools(
    world: World, cap: Captured
) -> None:
    async with Client(refund_server(world)) as client:
        tools = await load_tools(client.session, DECLARE, unwind_on_tool_error=True)
        saga = cap.saga("refund", tools=tools.registry)
        run = saga.run()
        with pytest.raises(McpToolError, match="mail service unavailable"):
            async with run:
                session = tools.bind(run)
                for call_id, name, args in SCRIPT:
                    await session.call_tool(name, args, call_id=call_id)
        assert run.report is not None and run.report.status is RunStatus.COMPENSATED
        # The world is as it was, by the server's own tools: credit reversed, ticket reopened.
        assert world.balance(4921) == 0 and world.ledger[-1]["reverses"] == "cr_9104_4921"
        assert world.tickets == {"T-9104": "open"}
        spans = cap.spans()
        assert contract_violations(spans) == []
        undos = [span_attrs(s) for s in cap.spans(phase="compensate")]
        assert [(u[sc.SAGA_STEP_NAME], u[sc.SAGA_COMPENSATION_TOOL]) for u in undos] == [
            ("set_ticket_status", "set_ticket_status"),
            ("issue_credit", "reverse_credit"),
        ]
        assert json.loads(undos[0][sc.SAGA_COMPENSATION_ARGS]) == {
            "ticket_id": "T-9104",
            "status": "open",
        }
        dos = [span_attrs(s) for s in cap.spans(phase="do")]
        assert [d[sc.GEN_AI_TOOL_CALL_ID] for d in dos] == ["call_1", "call_2", "call_3", "call_4"]
        assert [d[sc.SAGA_STEP_CLASS] for d in dos] == [
            "read",
            "compensable",
            "reversible",
            "irreversible",
        ]


async def test_a_tool_error_is_a_failed_step_handed_back_not_an_unwind(
    world: World, cap: Captured
) -> None:
    async with Client(refund_server(world)) as client:
        tools = await load_tools(client.session, DECLARE)
        run = cap.saga("refund", tools=tools.registry).run()
        async with run:
            session = tools.bind(run)
            results = [await session.call_tool(n, a, call_id=c) for c, n, a in SCRIPT]
        reply = results[-1]
        assert reply.is_error and "mail service unavailable" in str(decode_result(reply))
        assert run.report is not None and run.report.status is RunStatus.COMPLETED
        assert [(s.name, s.ok) for s in run.report.steps][-1] == ("send_reply", False)
        assert world.balance(4921) == 2500 and world.tickets == {"T-9104": "refunded"}
        assert cap.spans(phase="unwind") == []


async def test_idempotency_key_goes_only_to_tools_whose_schema_takes_it(
    world: World, cap: Captured
) -> None:
    async with Client(refund_server(world)) as client:
        tools = await load_tools(client.session, DECLARE)
        assert tools.registry.get("issue_credit").accepts_idempotency_key
        assert not tools.registry.get("set_ticket_status").accepts_idempotency_key
        async with cap.saga("refund", tools=tools.registry).run() as run:
            a = await tools.call_tool(run, "issue_credit", {"order_id": 4921, "amount": 10})
            await tools.call_tool(run, "set_ticket_status", {"ticket_id": "T-9104", "status": "x"})
        assert decode_result(a)["credit_id"] == world.ledger[0]["credit_id"]
        assert len(world.ledger) == 1


async def test_cancellation_unwinds_shielded_through_the_same_session(
    world: World, cap: Captured
) -> None:
    server = refund_server(world)
    stalled = asyncio.Event()

    @server.tool(annotations=mt.ToolAnnotations(read_only_hint=True))
    async def wait_for_human() -> str:
        stalled.set()
        await asyncio.Event().wait()
        return "never"

    async with Client(server) as c:
        tools = await load_tools(c.session, DECLARE)
        run = cap.saga("refund", tools=tools.registry).run()

        async def agent() -> None:
            async with run:
                await tools.call_tool(run, "issue_credit", {"order_id": 4921, "amount": 2500})
                await tools.call_tool(run, "wait_for_human", {})

        task = asyncio.create_task(agent())
        await stalled.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0


async def test_a_failure_in_the_agent_itself_unwinds(world: World, cap: Captured) -> None:
    async with Client(refund_server(world)) as client:
        tools = await load_tools(client.session, DECLARE)
        run = cap.saga("refund", tools=tools.registry).run()
        with pytest.raises(KeyError):
            async with run:
                await tools.call_tool(run, "issue_credit", {"order_id": 4921, "amount": 2500})
                raise KeyError("the agent's own bug")
        assert run.report is not None and run.report.status is RunStatus.COMPENSATED
        assert world.balance(4921) == 0


BARE_SERVER = """
from mcp.server.mcpserver import MCPServer
server = MCPServer("bare")
@server.tool()
def ping() -> str:
    return "pong"
@server.tool()
def wipe(path: str) -> str:
    return path
server.run("stdio")
"""


def test_cli_prints_the_mapping_of_a_stdio_server(capsys: pytest.CaptureFixture[str]) -> None:
    from saga_otel._cli import main

    server = [sys.executable, "-m", "examples.mcp_refund_server"]
    assert main(["mcp-tools", "--declare", "examples.mcp_refund_agent:DECLARE", "--", *server]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["tool", "class", "pivot", "from", "hints", "undo"]
    assert "reverse_credit(credit_id=result.credit_id)" in out
    # Without the declarations the writes the server calls destructive are pivots.
    assert main(["mcp-tools", *server]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "irreversible  yes" in lines["set_ticket_status"]


def test_cli_exits_1_listing_unclassified_tools(capsys: pytest.CaptureFixture[str]) -> None:
    from saga_otel._cli import main

    assert main(["mcp-tools", sys.executable, "-c", BARE_SERVER]) == 1
    captured = capsys.readouterr()
    assert "UNCLASSIFIED" in captured.out
    (line,) = captured.err.splitlines()
    assert "(no annotations, no declaration): ping, wipe" in line
    args = ["mcp-tools", "--unannotated", "irreversible", sys.executable, "-c", BARE_SERVER]
    assert main(args) == 0


def test_cli_refuses_a_declare_that_is_not_declarations(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from saga_otel._cli import main

    with pytest.raises(SystemExit) as ended:
        main(["mcp-tools", "--declare", "examples.mcp_refund_agent:SCRIPT", "python"])
    assert ended.value.code == 2
    assert "not a dict of tool name to Declare" in capsys.readouterr().err
    assert main(["mcp-tools", "/nonexistent/server"]) == 2
    assert "cannot list the tools" in capsys.readouterr().err


LOOPING_SERVER = """
import anyio
import mcp.types as mt
from mcp.server import Server
from mcp.server.stdio import stdio_server
async def on_list_tools(_ctx, params):
    return mt.ListToolsResult(tools=[mt.Tool(name="t", input_schema={"type": "object"})],
                              next_cursor="again")
server = Server("looping", on_list_tools=on_list_tools)
async def main():
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())
anyio.run(main)
"""


def test_cli_names_the_error_inside_the_mcp_client_s_task_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The MCP client raises from task groups: the line names the error in it, not the group."""
    from saga_otel._cli import main

    exits = [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert main(["mcp-tools", "--", *exits]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"saga-otel: cannot list the tools of {' '.join(exits)!r}: MCPError: ")
    assert line.endswith(
        "; the server exited or does not speak MCP on stdio: run the command alone to see its error"
    )
    assert "TaskGroup" not in line
    # An error of ours raised inside the group is its own line, with its fix.
    assert main(["mcp-tools", sys.executable, "-c", LOOPING_SERVER]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "saga-otel: the MCP server's tools/list does not end: cursor 'again' came back again "
        "(2 tools so far); fix the server's pagination"
    )
    # A command that cannot start: the OS says why; no hint about a server that ran.
    assert main(["mcp-tools", "/nonexistent/server"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("FileNotFoundError: [Errno 2] No such file or directory: "
                         "'/nonexistent/server'")  # fmt: skip


def paged_server(pages: Callable[[str | None], mt.ListToolsResult]) -> Server[Any]:
    """A low-level MCP server whose tools/list answers ``pages(cursor)``."""

    async def on_list_tools(_ctx: Any, params: mt.PaginatedRequestParams | None) -> Any:
        return pages(params.cursor if params else None)

    return Server("paged", on_list_tools=on_list_tools)


def three_pages(cursor: str | None) -> mt.ListToolsResult:
    ro = mt.ToolAnnotations(read_only_hint=True)
    page = {None: ("get_order", "p2"), "p2": ("get_ticket", "p3"), "p3": ("close_ticket", None)}
    name, after = page[cursor]
    return mt.ListToolsResult(tools=[_tool(name, None if after is None else ro)], next_cursor=after)


@pytest.mark.parametrize("via", ["ClientSession", "Client"])
async def test_every_page_of_the_tool_list_is_loaded(via: str) -> None:
    async with Client(paged_server(three_pages)) as client:
        session: Any = client.session if via == "ClientSession" else client  # params= / cursor=
        declared = {"close_ticket": Declare(step_class="irreversible")}  # on the last page
        tools = await load_tools(session, declared)
    assert list(tools.registry) == ["get_order", "get_ticket", "close_ticket"]
    assert tools.registry.get("close_ticket").step_class is StepClass.IRREVERSIBLE


async def test_a_tool_list_that_does_not_end_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def looping(cursor: str | None) -> mt.ListToolsResult:
        return mt.ListToolsResult(tools=[_tool(f"t{cursor}")], next_cursor="again")

    def endless(cursor: str | None) -> mt.ListToolsResult:
        n = int(cursor or 0) + 1
        return mt.ListToolsResult(tools=[_tool(f"t{n}")], next_cursor=str(n))

    monkeypatch.setattr(mcp_adapter, "_MAX_TOOL_PAGES", 5)
    for pages, match in [
        (looping, r"does not end: cursor 'again' came back again \(2 tools so far\)"),
        (endless, r"does not end: cursor '5' after 5 pages \(5 tools so far\)"),
    ]:
        async with Client(paged_server(pages)) as client:
            with pytest.raises(ConfigurationError, match=match):
                await load_tools(client.session, unannotated="irreversible")


async def test_a_session_that_cannot_ask_for_the_next_page_is_refused() -> None:
    class OnePage:
        async def list_tools(self) -> mt.ListToolsResult:
            return mt.ListToolsResult(tools=[_tool("a")], next_cursor="p2")

        async def call_tool(self, name: str, arguments: Any = None) -> mt.CallToolResult:
            raise AssertionError("not called")

    with pytest.raises(ConfigurationError, match=r"OnePage.list_tools\(\) takes neither cursor="):
        await load_tools(OnePage(), unannotated="irreversible")


class OddSession:
    """A session of the user's making whose call_tool returns ``answer``, not a CallToolResult."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    async def list_tools(self) -> mt.ListToolsResult:
        return mt.ListToolsResult(
            tools=[
                _tool("get_ticket", mt.ToolAnnotations(read_only_hint=True), ticket_id="string"),
                _tool("set_status", mt.ToolAnnotations(), ticket_id="string", status="string"),
            ]
        )

    async def call_tool(self, name: str, arguments: Any = None) -> Any:
        return self.answer


async def test_a_session_answering_something_else_is_named_with_the_fix(cap: Captured) -> None:
    declare = {
        "set_status": Declare(
            undo="set_status",
            snapshot="get_ticket",
            undo_args={"ticket_id": "args.ticket_id", "status": "snapshot.status"},
        )
    }
    tools = await load_tools(OddSession(None), declare)
    with pytest.raises(
        ConfigurationError,
        match=r"MCP tool 'get_ticket': OddSession.call_tool\(\) returned None, not an "
        r"mcp.types.CallToolResult; pass an mcp.ClientSession or mcp.Client",
    ):
        async with cap.saga("odd", tools=tools.registry).run() as run:
            await tools.call_tool(run, "get_ticket", {"ticket_id": "T-1"})
    # The snapshot read before an overwrite says the same; a dict shows its keys, no values.
    tools = await load_tools(OddSession({"content": [], "isError": False}), declare)
    snapshot = tools.registry.get("set_status").snapshot
    assert snapshot is not None
    with pytest.raises(ConfigurationError, match=r"returned a dict with keys content, isError,"):
        await snapshot(ticket_id="T-1", status="closed")
