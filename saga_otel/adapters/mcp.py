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

import inspect
import json
import keyword
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

try:
    import mcp.types as mcp_types
except ImportError as exc:  # pragma: no cover - exercised by the library-only install
    raise ImportError(
        "saga_otel.adapters.mcp needs the MCP SDK: pip install 'saga-otel[mcp]'"
    ) from exc

from saga_otel import (
    CallInfo,
    ConfigurationError,
    RetryPolicy,
    Run,
    SagaError,
    StepClass,
    Tool,
    ToolRegistry,
    tool_call_id,
)

__all__ = [
    "BoundSession",
    "Declare",
    "McpSession",
    "McpToolError",
    "McpTools",
    "ToolMapping",
    "classify",
    "decode_result",
    "load_tools",
    "map_tools",
    "review",
]

IDEMPOTENCY_PARAM = "idempotency_key"
_PATH_ROOTS = ("args", "result", "snapshot")
Unannotated = Literal["refuse", "irreversible"]


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


ArgsSpec = Mapping[str, Any] | Callable[[CallInfo], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Declare:
    """What the user says about one MCP tool, overriding or completing its annotations.

    ``undo`` names another tool of the same server that undoes this one.
    ``undo_args`` maps the undo's parameters to paths into the call,
    ``"result.credit_id"``, ``"args.ticket_id"``, ``"snapshot.status"`` (a
    non-string value is a constant), or is a function of the
    :class:`~saga_otel.CallInfo` (whose ``result`` is the decoded result).
    Without it, the undo's parameters are filled by name from the snapshot,
    the result and the arguments. ``snapshot`` names a read tool called with the
    do's arguments before the write: the tool becomes ``reversible``.
    """

    step_class: StepClass | str | None = None
    undo: str | None = None
    undo_args: ArgsSpec | None = None
    snapshot: str | None = None
    describe: str | Callable[[CallInfo], str] | None = None
    pivot: bool = False
    retry: RetryPolicy | None = None


@dataclass(frozen=True, slots=True)
class ToolMapping:
    """One tool's row in the review: its class, where the class came from, its undo."""

    name: str
    step_class: StepClass | None  # None: unclassified
    source: Literal["annotations", "declared", "default", "unclassified"]
    hints: str
    pivot: bool = False
    undo: str | None = None
    undo_args: str = ""
    snapshot: str | None = None
    destructive: bool = False

    @property
    def is_pivot(self) -> bool:
        return self.pivot or self.step_class is StepClass.IRREVERSIBLE


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


def _args_text(spec: ArgsSpec | None) -> str:
    if spec is None:
        return "(by name)"
    if callable(spec):
        return f"{getattr(spec, '__name__', 'function')}(call)"
    return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in spec.items())


def _check_paths(name: str, spec: ArgsSpec | None) -> None:
    if spec is None or callable(spec):
        return
    for key, value in spec.items():
        if isinstance(value, str) and value.split(".", 1)[0] not in _PATH_ROOTS:
            raise ConfigurationError(
                f"MCP tool {name!r}: undo_args[{key!r}]={value!r} is not a path into the call; "
                "start it with result., args. or snapshot (e.g. 'result.credit_id')"
            )


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
    declare = dict(declare or {})
    names = {t.name for t in tools}
    unknown = sorted(set(declare) - names)
    if unknown:
        raise ConfigurationError(
            f"declarations name tools the MCP server does not offer: {', '.join(unknown)} "
            f"(it offers: {', '.join(sorted(names)) or 'none'}); fix the names"
        )
    if unannotated not in ("refuse", "irreversible"):
        raise ConfigurationError(
            f"unannotated={unannotated!r}: use 'refuse' (the default) or 'irreversible'"
        )
    rows: list[ToolMapping] = []
    for t in tools:
        d = declare.get(t.name)
        hints, destructive = _hint_text(t.annotations), _destructive(t.annotations)
        derived = classify(t.annotations)
        if d is None:
            if derived is None and unannotated == "irreversible":
                rows.append(
                    ToolMapping(t.name, StepClass.IRREVERSIBLE, "default", hints, destructive=True)
                )
            elif derived is None:
                rows.append(ToolMapping(t.name, None, "unclassified", hints))
            else:
                rows.append(
                    ToolMapping(t.name, derived, "annotations", hints, destructive=destructive)
                )
            continue
        for role, other in (("undo", d.undo), ("snapshot", d.snapshot)):
            if other is not None and other not in names:
                raise ConfigurationError(
                    f"MCP tool {t.name!r} names {other!r} as its {role}, which the server does "
                    f"not offer (it offers: {', '.join(sorted(names))}); name one of its tools"
                )
        if d.snapshot is not None and d.undo is None:
            raise ConfigurationError(
                f"MCP tool {t.name!r} has a snapshot but no undo: add undo='<tool that writes "
                "the value back>' (often the tool itself)"
            )
        _check_paths(t.name, d.undo_args)
        if d.step_class is not None:
            cls = StepClass.parse(d.step_class)
        elif d.undo is not None:
            cls = StepClass.REVERSIBLE if d.snapshot is not None else StepClass.COMPENSABLE
        elif derived is not None:
            cls = derived
        elif unannotated == "irreversible":
            cls = StepClass.IRREVERSIBLE
        else:
            rows.append(ToolMapping(t.name, None, "unclassified", hints, pivot=d.pivot))
            continue
        if d.undo is not None and not cls.pushes:
            raise ConfigurationError(
                f"MCP tool {t.name!r} declares undo={d.undo!r} but class {cls.value}, which "
                "keeps no undo: declare it compensable (or reversible with a snapshot)"
            )
        if cls.pushes and d.undo is None:
            raise ConfigurationError(
                f"MCP tool {t.name!r} is declared {cls.value} but names no undo: add "
                "undo='<tool of the same server that undoes it>'"
            )
        if destructive and d.undo is None and cls is not StepClass.IRREVERSIBLE:
            raise ConfigurationError(
                f"MCP tool {t.name!r} is destructive ({hints}) and has no undo, so it can only "
                f"be irreversible, not {cls.value}: declare undo='<tool that undoes it>' or "
                "drop the class override"
            )
        rows.append(
            ToolMapping(
                t.name,
                cls,
                "declared",
                hints,
                pivot=d.pivot,
                undo=d.undo,
                undo_args=_args_text(d.undo_args) if d.undo else "",
                snapshot=d.snapshot,
                destructive=destructive,
            )
        )
    return rows


def review(rows: Iterable[ToolMapping]) -> str:
    """The mapping as a table a person reads before the agent runs."""
    head = ("tool", "class", "pivot", "from", "hints", "undo")
    lines = [head]
    for r in rows:
        undo = "-"
        if r.undo:
            undo = f"{r.undo}({r.undo_args})"
            if r.snapshot:
                undo += f" after snapshot {r.snapshot}"
        cls = r.step_class.value if r.step_class else "UNCLASSIFIED"
        lines.append((r.name, cls, "yes" if r.is_pivot else "", r.source, r.hints, undo))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line[:-1], widths, strict=True)) + "  " + line[-1]
        for line in lines
    )


def _refusal(rows: Sequence[ToolMapping]) -> str | None:
    missing = [r.name for r in rows if r.step_class is None]
    if not missing:
        return None
    return (
        f"MCP tools with no annotations and no declaration: {', '.join(missing)}. Declare "
        "each one's class (declare={name: Declare(step_class=...)}), or pass "
        "unannotated='irreversible' to treat them all as pivots"
    )


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


def _lookup(info: CallInfo, path: str) -> Any:
    root, *rest = path.split(".")
    value: Any = {"args": info.args, "result": info.result, "snapshot": info.snapshot}[root]
    for part in rest:
        if isinstance(value, Mapping):
            value = value[part]
        elif isinstance(value, list | tuple) and part.isdigit():
            value = value[int(part)]
        else:
            raise KeyError(f"{path!r}: {part!r} not found in {value!r}")
    return value


def _decoded(info: CallInfo) -> CallInfo:
    result = info.result
    return replace(
        info,
        result=decode_result(result) if isinstance(result, mcp_types.CallToolResult) else result,
    )


def _undo_recipe(spec: ArgsSpec | None, undo_params: Sequence[str]) -> Callable[..., Any]:
    def recipe(info: CallInfo) -> Mapping[str, Any]:
        info = _decoded(info)
        if callable(spec):
            return dict(spec(info))
        if spec is not None:
            return {k: _lookup(info, v) if isinstance(v, str) else v for k, v in dict(spec).items()}
        # By name: the snapshot's fields, then the result's, then the do's own arguments.
        pool: dict[str, Any] = dict(info.args)
        for source in (info.result, info.snapshot):
            if isinstance(source, Mapping):
                pool.update(source)
        return {p: pool[p] for p in undo_params if p in pool and p != IDEMPOTENCY_PARAM}

    return recipe


def _describe(d: Declare) -> str | Callable[[CallInfo], str] | None:
    if callable(d.describe):
        user = d.describe
        return lambda info: user(_decoded(info))
    return d.describe


def _params(t: mcp_types.Tool) -> list[str]:
    props = t.input_schema.get("properties") or {}
    return [str(p) for p in props]


def _caller(session: McpSession, t: mcp_types.Tool) -> Callable[..., Any]:
    name = t.name

    async def call(**kwargs: Any) -> mcp_types.CallToolResult:
        result = await session.call_tool(name, kwargs)
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
        result = await session.call_tool(t.name, args)
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
    refusal = _refusal(rows)
    if refusal is not None:
        raise ConfigurationError(refusal)
    by_name = {t.name: t for t in definitions}
    registry = ToolRegistry()
    for row in rows:
        t, d = by_name[row.name], declare.get(row.name, Declare())
        assert row.step_class is not None
        registry.register(
            Tool(
                name=row.name,
                fn=_caller(session, t),
                step_class=row.step_class,
                compensate=row.undo,
                compensate_args=(
                    _undo_recipe(d.undo_args, _params(by_name[row.undo])) if row.undo else None
                ),
                describe=_describe(d),
                snapshot=_snapshotter(session, by_name[row.snapshot]) if row.snapshot else None,
                retry=d.retry,
                pivot=row.pivot,
            )
        )
    registry.check_compensations()
    return McpTools(
        session,
        registry,
        tuple(rows),
        unwind_on_tool_error=unwind_on_tool_error,
        definitions=tuple(definitions),
    )


async def list_all_tools(session: McpSession) -> list[mcp_types.Tool]:
    """Every tool the server offers (a session's ``list_tools``, one page)."""
    listed = await session.list_tools()
    return list(listed.tools)


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
    return rows, _refusal(rows)
