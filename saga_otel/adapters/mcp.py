"""MCP client sessions as saga tools: ``pip install 'saga-otel[mcp]'``.

:func:`load_tools` lists a session's tools and makes each a saga :class:`~saga_otel.Tool`
whose function calls the server. Its step class comes from the server's tool
annotations (:func:`classify`, the table in docs/frameworks.md), or from what
the user declares per tool name (:class:`Declare`): a class, and an undo that
names another tool of the same server with its arguments mapped from the do's
arguments, result or snapshot. Nothing is guessed silently:

* a tool with neither annotations nor a declaration is refused at start, with
  the list of such tools, unless ``unannotated="irreversible"`` is passed;
* a tool the server calls destructive (explicitly, or by MCP's default
  ``destructiveHint: true``) is ``irreversible`` (a pivot) unless it has an undo.

:func:`review` (and ``saga-otel mcp-tools``) prints each tool's class and undo
so a person can check the mapping before the agent runs.

The model's tool errors (``CallToolResult.is_error``) are failed steps handed
back to the caller as the result, as MCP means them to be, unless
``unwind_on_tool_error=True``; protocol errors and anything else that escapes
the run unwind it. MCP itself carries no model tool-call id (the JSON-RPC
request id is the client's own), so the caller passes the framework's id as
``call_id=``; it becomes ``gen_ai.tool.call.id``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import inspect
import json
import keyword
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

try:
    import mcp.types as mcp_types
except ImportError as exc:  # pragma: no cover - exercised by the library-only install
    raise ImportError(
        "saga_otel.adapters.mcp needs the MCP SDK: pip install 'saga-otel[mcp]'"
    ) from exc

from saga_otel import (
    ConfigurationError,
    Run,
    SagaError,
    StepClass,
    ToolRegistry,
    tool_call_id,
)
from saga_otel.adapters._declare import (
    Declare,
    Described,
    ToolMapping,
    Unannotated,
    build_registry,
    map_declared,
    refusal,
    review,
)
from saga_otel.records import describe_error

__all__ = [
    "BoundSession",
    "Declare",
    "McpSession",
    "McpToolError",
    "McpTools",
    "ToolMapping",
    "blocking_registry",
    "classify",
    "decode_result",
    "load_tools",
    "map_tools",
    "review",
]


class McpSession(Protocol):
    """What the adapter needs of a session: ``mcp.ClientSession`` and ``mcp.Client`` fit."""

    async def list_tools(self) -> mcp_types.ListToolsResult: ...

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None
    ) -> mcp_types.CallToolResult: ...


class McpToolError(SagaError):
    """The server answered a tool call with ``is_error``: the model's kind of tool error."""

    def __init__(self, tool: str, result: mcp_types.CallToolResult) -> None:
        text = " ".join(c.text for c in result.content if isinstance(c, mcp_types.TextContent))
        super().__init__(f"MCP tool {tool!r} returned an error: {text or '(no text)'}")
        self.tool = tool
        self.result = result


def _hints(ann: mcp_types.ToolAnnotations | None) -> dict[str, bool]:
    if ann is None:
        return {}
    pairs = {
        "readOnlyHint": ann.read_only_hint,
        "destructiveHint": ann.destructive_hint,
        "idempotentHint": ann.idempotent_hint,
        "openWorldHint": ann.open_world_hint,
    }
    return {k: v for k, v in pairs.items() if v is not None}


def _destructive(ann: mcp_types.ToolAnnotations | None) -> bool:
    """The server says the tool may destroy: explicitly, or by MCP's default when it annotates."""
    hints = _hints(ann)
    if not hints or hints.get("readOnlyHint") is True:
        return False
    return hints.get("destructiveHint", True)  # MCP: destructiveHint defaults to true


def classify(ann: mcp_types.ToolAnnotations | None) -> StepClass | None:
    """The step class an MCP tool's annotations give it, before any declaration.

    No hints at all: ``None`` (unclassified). ``readOnlyHint``: ``read``.
    Otherwise MCP's defaults apply (``destructiveHint`` true, ``idempotentHint``
    false): idempotent and not destructive is ``convergent``; anything else
    (destructive, or additive but not idempotent) has no undo the server
    declares, so it is ``irreversible``, a pivot. ``openWorldHint`` does not
    change the class.
    """
    hints = _hints(ann)
    if not hints:
        return None
    if hints.get("readOnlyHint") is True:
        return StepClass.READ
    if not _destructive(ann) and hints.get("idempotentHint", False):
        return StepClass.CONVERGENT
    return StepClass.IRREVERSIBLE


def _hint_text(ann: mcp_types.ToolAnnotations | None) -> str:
    hints = _hints(ann)
    return ",".join(f"{k[: -len('Hint')]}={'y' if v else 'n'}" for k, v in hints.items()) or "-"


def map_tools(
    tools: Sequence[mcp_types.Tool],
    declare: Mapping[str, Declare] | None = None,
    *,
    unannotated: Unannotated = "refuse",
) -> list[ToolMapping]:
    """Each tool's class and undo (pure; no tool is called). Unclassified rows stay in.

    Raises :class:`~saga_otel.ConfigurationError` for a declaration that cannot
    hold: an unknown tool or undo, or a destructive tool mapped to anything but
    ``irreversible`` without an undo.
    """
    described = [
        Described(
            t.name, classify(t.annotations), _destructive(t.annotations), _hint_text(t.annotations)
        )
        for t in tools
    ]
    return map_declared(described, declare, unannotated=unannotated, where="the MCP server")


def decode_result(result: mcp_types.CallToolResult) -> Any:
    """A call's result as plain data: the structured content, else the text (JSON if it parses)."""
    if result.structured_content is not None:
        return result.structured_content
    texts = [c.text for c in result.content if isinstance(c, mcp_types.TextContent)]
    if len(texts) != 1:
        return texts or None
    try:
        return json.loads(texts[0])
    except ValueError:
        return texts[0]


def _params(t: mcp_types.Tool) -> list[str]:
    props = t.input_schema.get("properties") or {}
    return [str(p) for p in props]


def _decode(result: Any) -> Any:
    return decode_result(result) if isinstance(result, mcp_types.CallToolResult) else result


def _checked(session: McpSession, name: str, result: object) -> mcp_types.CallToolResult:
    # A session of the user's making may return anything: say what, not `no attribute is_error`.
    if not isinstance(result, mcp_types.CallToolResult):
        raise ConfigurationError(
            f"MCP tool {name!r}: {type(session).__name__}.call_tool() returned "
            f"{_kind(result)}, not an mcp.types.CallToolResult; pass an mcp.ClientSession or "
            "mcp.Client, or make call_tool return a CallToolResult"
        )
    return result


def _kind(value: object) -> str:
    """What a value is, without its contents (a tool's result may hold anyone's data)."""
    if value is None:
        return "None"
    if isinstance(value, Mapping):
        keys = [str(k) for k in list(value)[:6]] + (["..."] if len(value) > 6 else [])
        return f"a {type(value).__name__} with keys {', '.join(keys) or '(none)'}"
    return f"a {type(value).__name__}"


def _caller(session: McpSession, t: mcp_types.Tool) -> Callable[..., Any]:
    name = t.name

    async def call(**kwargs: Any) -> mcp_types.CallToolResult:
        result = _checked(session, name, await session.call_tool(name, kwargs))
        if result.is_error:
            raise McpToolError(name, result)
        return result

    # The engine passes idempotency_key only to a tool whose signature takes it:
    # expose the server's parameters, so it does exactly when the server's schema has one.
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY, default=None)
            for p in _params(t)
            if p.isidentifier() and not keyword.iskeyword(p)
        ]
    )
    call.__name__ = name
    return call


def _snapshotter(session: McpSession, t: mcp_types.Tool) -> Callable[..., Any]:
    wanted = set(_params(t))

    async def snap(**kwargs: Any) -> Any:
        args = {k: v for k, v in kwargs.items() if k in wanted}
        result = _checked(session, t.name, await session.call_tool(t.name, args))
        if result.is_error:
            raise McpToolError(t.name, result)
        return decode_result(result)

    return snap


@dataclass(slots=True)
class McpTools:
    """A session's tools as a :class:`~saga_otel.ToolRegistry`, with their review rows."""

    session: McpSession
    registry: ToolRegistry
    mappings: tuple[ToolMapping, ...]
    unwind_on_tool_error: bool = False
    definitions: tuple[mcp_types.Tool, ...] = field(default=())

    def review(self) -> str:
        return review(self.mappings)

    def bind(self, run: Run) -> BoundSession:
        """A session-like object whose ``call_tool`` goes through ``run``."""
        return BoundSession(self, run)

    async def call_tool(
        self,
        run: Run,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        call_id: str | None = None,
    ) -> mcp_types.CallToolResult:
        """One tool call as a saga step; returns the server's result, as a session would.

        A tool error (``is_error``) is a failed step whose result is returned for
        the model to read, unless ``unwind_on_tool_error``: then it raises
        :class:`McpToolError`, and the run unwinds when it leaves the ``async with``.
        """
        try:
            with tool_call_id(call_id):
                result: mcp_types.CallToolResult = await run.call(name, **dict(arguments or {}))
        except McpToolError as exc:
            if self.unwind_on_tool_error:
                raise
            return exc.result
        return result


@dataclass(frozen=True, slots=True)
class BoundSession:
    """``McpTools.bind(run)``: ``call_tool``/``list_tools`` like a session, inside the run."""

    tools: McpTools
    run: Run

    async def list_tools(self) -> mcp_types.ListToolsResult:
        return mcp_types.ListToolsResult(tools=list(self.tools.definitions))

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        *,
        call_id: str | None = None,
    ) -> mcp_types.CallToolResult:
        return await self.tools.call_tool(self.run, name, arguments, call_id=call_id)


def build_tools(
    session: McpSession,
    definitions: Sequence[mcp_types.Tool],
    declare: Mapping[str, Declare] | None = None,
    *,
    unannotated: Unannotated = "refuse",
    unwind_on_tool_error: bool = False,
) -> McpTools:
    """:func:`load_tools` on tool definitions already listed."""
    declare = dict(declare or {})
    rows = map_tools(definitions, declare, unannotated=unannotated)
    refused = refusal(rows)
    if refused is not None:
        raise ConfigurationError(refused)
    by_name = {t.name: t for t in definitions}
    registry = build_registry(
        rows,
        declare,
        call=lambda name: _caller(session, by_name[name]),
        params=lambda name: _params(by_name[name]),
        snapshot=lambda name: _snapshotter(session, by_name[name]),
        decode=_decode,
    )
    return McpTools(
        session,
        registry,
        tuple(rows),
        unwind_on_tool_error=unwind_on_tool_error,
        definitions=tuple(definitions),
    )


_MAX_TOOL_PAGES = 1000  # past this a server's cursor is taken to loop, not to end


async def list_all_tools(session: McpSession) -> list[mcp_types.Tool]:
    """Every tool the server offers: each page of ``tools/list``, following ``next_cursor``.

    The cursor goes to ``list_tools`` as ``cursor=`` (``mcp.Client``) or as
    ``params=`` (``mcp.ClientSession``). Raises :class:`~saga_otel.ConfigurationError`
    when the server repeats a cursor, sends more than 1,000 pages, or
    has a next page the session gives no way to ask for.
    """
    listed = await session.list_tools()
    tools = list(listed.tools)
    seen: set[str] = set()
    while listed.next_cursor is not None:
        cursor = listed.next_cursor
        if cursor in seen or len(seen) + 1 >= _MAX_TOOL_PAGES:
            raise ConfigurationError(
                f"the MCP server's tools/list does not end: cursor {cursor!r} "
                + ("came back again" if cursor in seen else f"after {_MAX_TOOL_PAGES} pages")
                + f" ({len(tools)} tools so far); fix the server's pagination"
            )
        seen.add(cursor)
        listed = await _next_page(session, cursor)
        tools.extend(listed.tools)
    return tools


async def _next_page(session: McpSession, cursor: str) -> mcp_types.ListToolsResult:
    try:
        takes = inspect.signature(session.list_tools).parameters.values()
        names = {p.name for p in takes if p.kind is not inspect.Parameter.VAR_KEYWORD}
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes):
            names.add("cursor")
    except (TypeError, ValueError):  # no signature to read: try mcp.Client's keyword
        names = {"cursor"}
    page: mcp_types.ListToolsResult
    if "cursor" in names:
        page = await session.list_tools(cursor=cursor)  # type: ignore[call-arg]
    elif "params" in names:
        params = mcp_types.PaginatedRequestParams(cursor=cursor)
        page = await session.list_tools(params=params)  # type: ignore[call-arg]
    else:
        raise ConfigurationError(
            f"the MCP server has more tools than one page (next cursor {cursor!r}), and "
            f"{type(session).__name__}.list_tools() takes neither cursor= nor params=, so "
            "the rest cannot be listed; pass an mcp.ClientSession or mcp.Client"
        )
    return page


async def load_tools(
    session: McpSession,
    declare: Mapping[str, Declare] | None = None,
    *,
    unannotated: Unannotated = "refuse",
    unwind_on_tool_error: bool = False,
) -> McpTools:
    """List the session's tools and make each a saga tool (see the module docs).

    Raises :class:`~saga_otel.ConfigurationError`, naming every unclassified
    tool, when any tool has neither annotations nor a declaration.
    """
    definitions = await list_all_tools(session)
    return build_tools(
        session,
        definitions,
        declare,
        unannotated=unannotated,
        unwind_on_tool_error=unwind_on_tool_error,
    )


class _OneAtATime:
    """Runs calls on the session's loop for blocking callers, one at a time.

    A call past ``timeout``, or interrupted, is cancelled, and the caller waits (at
    most ``timeout`` more) until it has stopped: otherwise the engine's retry of an
    undo would start it again while the first still ran, and the server would run
    it twice. A call that will not stop holds back every later call until it does.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.loop = loop
        self.timeout = timeout
        self.lock = threading.Lock()
        self.running: tuple[str, concurrent.futures.Future[Any]] | None = None

    def run(self, name: str, make: Callable[[], Awaitable[Any]]) -> Any:
        with self.lock:
            self._wait_for_the_last(name)
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            tasks: list[asyncio.Future[Any]] = []

            def start() -> None:
                task = asyncio.ensure_future(make())
                tasks.append(task)
                task.add_done_callback(lambda t: _settle(done, t))

            def cancel() -> None:
                if tasks:
                    tasks[0].cancel()

            self.loop.call_soon_threadsafe(start)
            try:
                answered = bool(concurrent.futures.wait([done], self.timeout).done)
            except BaseException:  # interrupted (KeyboardInterrupt, SystemExit): stop it too
                self._stop(name, done, tasks, cancel)
                raise
            if not answered:
                self._stop(name, done, tasks, cancel)
                # A call that succeeded as it was being cancelled did its work: keep it.
                succeeded = done.done() and not done.cancelled() and done.exception() is None
                if not succeeded:
                    raise TimeoutError(
                        f"MCP tool {name!r} did not answer within {self.timeout}s and was "
                        "cancelled; give blocking_registry() a larger timeout= if it needs longer"
                    )
            return done.result()

    def _wait_for_the_last(self, name: str) -> None:
        if self.running is None:
            return
        before, pending = self.running
        concurrent.futures.wait([pending], self.timeout)
        if not pending.done():
            raise TimeoutError(
                f"MCP tool {name!r} not started: {before!r} timed out and was cancelled but "
                "is still running, and the server may yet finish it; retry once it has stopped"
            )
        self.running = None

    def _stop(
        self,
        name: str,
        done: concurrent.futures.Future[Any],
        tasks: list[asyncio.Future[Any]],
        cancel: Callable[[], None],
    ) -> None:
        # call_soon_threadsafe keeps order: cancel() runs after start(), so a call
        # not started yet is cancelled before it sends anything.
        self.loop.call_soon_threadsafe(cancel)
        concurrent.futures.wait([done], self.timeout)
        if not done.done() and tasks:
            self.running = (name, done)


def _settle(done: concurrent.futures.Future[Any], task: asyncio.Future[Any]) -> None:
    if task.cancelled():
        done.cancel()
    elif (exc := task.exception()) is not None:
        done.set_exception(exc)
    else:
        done.set_result(task.result())


def blocking_registry(
    connect: Callable[[], AbstractAsyncContextManager[Any]],
    declare: Mapping[str, Declare] | None = None,
    *,
    unannotated: Unannotated = "refuse",
    timeout: float = 30.0,
) -> ToolRegistry:
    """The server's tools as a registry of plain (blocking) functions: for ``saga-otel recover``.

    ``connect()`` opens a session (an ``mcp.Client``, or anything whose
    ``async with`` yields a session); it is held open on a background thread's
    event loop until the process exits. Calls run one at a time; one that does not
    answer within ``timeout`` seconds (or is interrupted) is cancelled, and the
    caller waits until it has stopped (at most ``timeout`` more) before raising
    :class:`TimeoutError`, so a retry never runs the undo beside it. A call that
    will not stop holds back later calls until it does. The classes, undos and
    arguments are :func:`load_tools`'s.
    """
    loop = asyncio.new_event_loop()
    ready: concurrent.futures.Future[tuple[McpTools, asyncio.Event]] = concurrent.futures.Future()

    async def hold() -> None:
        try:
            async with connect() as opened:
                session = getattr(opened, "session", opened)
                tools = await load_tools(session, declare, unannotated=unannotated)
                stop = asyncio.Event()
                ready.set_result((tools, stop))
                await stop.wait()
        except BaseException as exc:
            if ready.done():
                raise
            ready.set_exception(exc)

    thread = threading.Thread(
        target=loop.run_until_complete, args=(hold(),), name="saga-otel-mcp", daemon=True
    )
    thread.start()
    try:
        tools, stop = ready.result(timeout)
    except SagaError:
        raise
    except Exception as exc:  # the server is down, the URL wrong, the handshake failed
        raise ConfigurationError(
            f"cannot open the MCP session for the registry ({describe_error(exc)}); check that "
            "the server is up and connect() points at it"
        ) from exc

    def close() -> None:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)

    atexit.register(close)

    calls = _OneAtATime(loop, timeout)

    def blocking(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = getattr(fn, "__name__", "mcp_tool")

        def call(**kwargs: Any) -> Any:
            return calls.run(name, lambda: fn(**kwargs))

        call.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        call.__name__ = name
        return call

    registry = ToolRegistry()
    for name in tools.registry:
        t = tools.registry.get(name)
        snapshot = blocking(t.snapshot) if t.snapshot is not None else None
        registry.register(dataclasses.replace(t, fn=blocking(t.fn), snapshot=snapshot))
    return registry


async def review_command(
    command: Sequence[str],
    declare: Mapping[str, Declare] | None = None,
    *,
    unannotated: Unannotated = "refuse",
) -> tuple[list[ToolMapping], str | None]:
    """Start ``command`` as an MCP server over stdio and map its tools (``saga-otel mcp-tools``).

    Returns the rows and the refusal :func:`load_tools` would raise (None when
    every tool is classified). The server gets this process's environment and
    working directory.
    """
    import os

    from mcp import Client, StdioServerParameters

    params = StdioServerParameters(
        command=command[0], args=list(command[1:]), env=dict(os.environ), cwd=os.getcwd()
    )
    async with Client(params) as client:
        definitions = await list_all_tools(client.session)
    rows = map_tools(definitions, declare, unannotated=unannotated)
    return rows, refusal(rows)
