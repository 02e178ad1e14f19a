"""What the adapters share, none of it tied to a framework: declarations, the mapping, undos.

Each adapter describes its framework's tools as :class:`Described` (name, the class
the framework's own metadata gives, whether it says the tool destroys), and
:func:`map_declared` applies the user's :class:`Declare` per tool name to them.
:func:`build_registry` turns the rows into saga tools whose functions call the
framework's own tool objects, and :class:`DeclaredTools` is what the
pydantic-ai, LangChain and OpenAI Agents SDK adapters share: the rows, the
registry, the review, and the one rule for telling the model's call (run
through the framework with the agent's context) from an undo or a snapshot
(run through the framework with a context built for it).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
import json
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from saga_otel import (
    CallInfo,
    ConfigurationError,
    RetryPolicy,
    SagaError,
    StepClass,
    Tool,
    ToolRegistry,
    current_call,
)
from saga_otel._outcome import is_async_callable
from saga_otel._registry import describe_text
from saga_otel._text import printable
from saga_otel.records import exception_text

IDEMPOTENCY_PARAM = "idempotency_key"
_PATH_ROOTS = ("args", "result", "snapshot")
Unannotated = Literal["refuse", "irreversible"]


class ToolErrorUnwind(SagaError):
    """A tool error the framework would hand to the model, raised to unwind the run instead
    (``unwind_on_tool_error=True``)."""

    @classmethod
    def of(cls, name: str, exc: BaseException) -> ToolErrorUnwind:
        return cls(f"tool {name!r} failed ({exception_text(exc)}) and unwind_on_tool_error is set")


ArgsSpec = Mapping[str, Any] | Callable[[CallInfo], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Declare:
    """What the user says about one MCP tool, overriding or completing its annotations.

    ``undo`` names another tool of the same server that undoes this one.
    ``undo_args`` maps the undo's parameters to paths into the call,
    ``"result.credit_id"``, ``"args.ticket_id"``, ``"snapshot.status"`` (keys,
    list indexes, fields of a model or dataclass; a non-string value is a
    constant), or is a function of the
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


class Described(NamedTuple):
    """One framework tool as the mapping sees it."""

    name: str
    derived: StepClass | None = None  # the class the framework's metadata gives; None: none
    destructive: bool = False  # the framework says the tool may destroy
    hints: str = "-"  # that metadata, for the review


def map_declared(
    tools: Sequence[Described],
    declare: Mapping[str, Declare] | None = None,
    *,
    unannotated: Unannotated = "refuse",
    where: str = "the toolset",
) -> list[ToolMapping]:
    """Each tool's class and undo (pure; no tool is called). Unclassified rows stay in.

    Raises :class:`~saga_otel.ConfigurationError` for a declaration that cannot
    hold: an unknown tool or undo, or a destructive tool mapped to anything but
    ``irreversible`` without an undo.
    """
    declare = dict(declare or {})
    names = {t.name for t in tools}
    offered = ", ".join(printable(n) for n in sorted(names))
    unknown = sorted(set(declare) - names)
    if unknown:
        raise ConfigurationError(
            f"declarations name tools {where} does not offer: {', '.join(unknown)} "
            f"(it offers: {offered or 'none'}); fix the names"
        )
    if unannotated not in ("refuse", "irreversible"):
        raise ConfigurationError(
            f"unannotated={unannotated!r}: use 'refuse' (the default) or 'irreversible'"
        )
    rows: list[ToolMapping] = []
    for t in tools:
        d = declare.get(t.name)
        hints, destructive, derived = t.hints, t.destructive, t.derived
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
                    f"tool {t.name!r} names {other!r} as its {role}, which {where} does not "
                    f"offer (it offers: {offered}); name one of its tools"
                )
        if d.snapshot is not None and d.undo is None:
            raise ConfigurationError(
                f"tool {t.name!r} has a snapshot but no undo: add undo='<tool that writes "
                "the value back>' (often the tool itself)"
            )
        check_paths(t.name, d.undo_args)
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
                f"tool {t.name!r} declares undo={d.undo!r} but class {cls.value}, which "
                "keeps no undo: declare it compensable (or reversible with a snapshot)"
            )
        if cls.pushes and d.undo is None:
            raise ConfigurationError(
                f"tool {t.name!r} is declared {cls.value} but names no undo: add "
                "undo='<tool that undoes it>'"
            )
        if destructive and d.undo is None and cls is not StepClass.IRREVERSIBLE:
            raise ConfigurationError(
                f"tool {t.name!r} is destructive ({hints}) and has no undo, so it can only "
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
                undo_args=args_text(d.undo_args) if d.undo else "",
                snapshot=d.snapshot,
                destructive=destructive,
            )
        )
    return rows


def review(rows: Iterable[ToolMapping]) -> str:
    """The mapping as a table a person reads before the agent runs."""
    head: tuple[str, ...] = ("tool", "class", "pivot", "from", "hints", "undo")
    lines = [head]
    for r in rows:
        undo = "-"
        if r.undo:
            undo = f"{r.undo}({r.undo_args})"
            if r.snapshot:
                undo += f" after snapshot {r.snapshot}"
        cls = r.step_class.value if r.step_class else "UNCLASSIFIED"
        row = (r.name, cls, "yes" if r.is_pivot else "", r.source, r.hints, undo)
        # Names come from a server: shown on a terminal, never obeyed (or a row broken).
        lines.append(tuple(printable(cell) for cell in row))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line[:-1], widths, strict=True)) + "  " + line[-1]
        for line in lines
    )


def refusal(rows: Sequence[ToolMapping]) -> str | None:
    missing = [printable(r.name) for r in rows if r.step_class is None]
    if not missing:
        return None
    return (
        f"tools with no class (no annotations, no declaration): {', '.join(missing)}. Declare "
        "each one's class (declare={name: Declare(step_class=...)}), or pass "
        "unannotated='irreversible' to treat them all as pivots"
    )


def args_text(spec: ArgsSpec | None) -> str:
    if spec is None:
        return "(by name)"
    if callable(spec):
        return f"{getattr(spec, '__name__', 'function')}(call)"
    return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in spec.items())


def check_paths(name: str, spec: ArgsSpec | None) -> None:
    if spec is None or callable(spec):
        return
    for key, value in spec.items():
        if isinstance(value, str) and value.split(".", 1)[0] not in _PATH_ROOTS:
            raise ConfigurationError(
                f"tool {name!r}: undo_args[{key!r}]={value!r} is not a path into the call; "
                "start it with result., args. or snapshot (e.g. 'result.credit_id')"
            )


_ABSENT = object()


def lookup(info: CallInfo, path: str) -> Any:
    """The value at ``path`` ("result.credit_id") in the call: a key of a mapping, an index
    of a list, or a field of an object (a pydantic model, a dataclass, a named tuple: what
    a tool returns and the model reads as JSON)."""
    root, *rest = path.split(".")
    value: Any = {"args": info.args, "result": info.result, "snapshot": info.snapshot}[root]
    for part in rest:
        value = _part(value, part, path)
    return value


def _part(value: Any, part: str, path: str) -> Any:
    if isinstance(value, Mapping):
        if part in value:
            return value[part]
    elif isinstance(value, list | tuple) and part.isdigit():
        if int(part) < len(value):
            return value[int(part)]
    elif not part.startswith("_") and not isinstance(value, str | bytes):
        field_value = getattr(value, part, _ABSENT)
        if field_value is not _ABSENT and not callable(field_value):  # a field, not a method
            return field_value
    shown = repr(value)
    shown = shown if len(shown) <= 120 else shown[:119] + "\u2026"
    raise ConfigurationError(
        f"undo_args path {path!r}: {part!r} is not in the {type(value).__name__} {shown}; "
        "name a key of a dict, an index of a list or a field of a model or dataclass that "
        "the tool returns, or give undo_args as a function of the call"
    )


def _fields(value: Any) -> Mapping[str, Any]:
    """A result's or snapshot's top-level fields, for filling an undo's parameters by name."""
    if isinstance(value, Mapping):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    model_fields = getattr(type(value), "model_fields", None)  # a pydantic model
    if isinstance(model_fields, Mapping):
        return {name: getattr(value, name) for name in model_fields}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return dict(zip(value._fields, value, strict=True))
    return {}


def undo_recipe(
    spec: ArgsSpec | None,
    undo_params: Sequence[str],
    decode: Callable[[Any], Any] = lambda result: result,
) -> Callable[[CallInfo], Mapping[str, Any]]:
    """The undo's arguments from the call: the declared paths, or by name."""

    def recipe(info: CallInfo) -> Mapping[str, Any]:
        info = replace(info, result=decode(info.result))
        if callable(spec):
            return dict(spec(info))
        if spec is not None:
            return {k: lookup(info, v) if isinstance(v, str) else v for k, v in spec.items()}
        # By name: the snapshot's fields, then the result's, then the do's own arguments.
        pool: dict[str, Any] = dict(info.args)
        for source in (info.result, info.snapshot):
            pool.update(_fields(source))
        return {p: pool[p] for p in undo_params if p in pool and p != IDEMPOTENCY_PARAM}

    return recipe


def _same(result: Any) -> Any:
    return result


def describe(
    d: Declare,
    decode: Callable[[Any], Any] = lambda result: result,
    undo_args: Callable[[CallInfo], Mapping[str, Any]] | None = None,
) -> str | Callable[[CallInfo], str] | None:
    """The declared description, seeing the decoded result: a function is called with it,
    a template formatted with it (and the undo's arguments, from ``undo_args``)."""
    if callable(d.describe):
        user = d.describe
        return lambda info: user(replace(info, result=decode(info.result)))
    template = d.describe
    if template is None or decode is _same or undo_args is None:
        return template  # the engine formats it with the result as it is

    def text(info: CallInfo) -> str:
        # The undo's arguments again: the recipe is a pure function of the call.
        decoded = replace(info, result=decode(info.result))
        return describe_text(template, decoded, undo_args(info))

    return text


def classified(
    tools: Sequence[Described],
    declare: Mapping[str, Declare] | None,
    *,
    unannotated: Unannotated,
    where: str,
) -> tuple[ToolMapping, ...]:
    """:func:`map_declared`, refusing at start, listed, the tools left with no class."""
    rows = map_declared(tools, declare, unannotated=unannotated, where=where)
    refused = refusal(rows)
    if refused is not None:
        raise ConfigurationError(refused)
    return tuple(rows)


def keyed_signature(params: Iterable[str]) -> inspect.Signature:
    """A saga tool function's signature: the engine passes the stable idempotency key
    only to a tool whose own parameters take it."""
    return inspect.Signature(
        [inspect.Parameter(IDEMPOTENCY_PARAM, inspect.Parameter.KEYWORD_ONLY, default=None)]
        if IDEMPOTENCY_PARAM in params
        else []
    )


def build_registry(
    rows: Iterable[ToolMapping],
    declare: Mapping[str, Declare],
    *,
    call: Callable[[str], Callable[..., Any]],
    params: Callable[[str], Sequence[str]],
    snapshot: Callable[[str], Callable[..., Any]],
    decode: Callable[[Any], Any] = _same,
) -> ToolRegistry:
    """The classified rows as saga tools: ``call(name)`` is each one's function,
    ``params(name)`` its parameters, ``snapshot(name)`` a read tool as a snapshot."""
    registry = ToolRegistry()
    for row in rows:
        assert row.step_class is not None  # classified() refused the others
        d = declare.get(row.name, Declare())
        recipe = undo_recipe(d.undo_args, params(row.undo), decode) if row.undo else None
        registry.register(
            Tool(
                name=row.name,
                fn=call(row.name),
                step_class=row.step_class,
                compensate=row.undo,
                compensate_args=recipe,
                describe=describe(d, decode, recipe),
                snapshot=snapshot(row.snapshot) if row.snapshot else None,
                retry=d.retry,
                pivot=row.pivot,
            )
        )
    registry.check_compensations()
    return registry


T = TypeVar("T")


class _Background:
    """One event loop on a daemon thread, for every blocking registry's calls: the
    framework's tool calls are async, a recovery's unwind is sync (and its caller may
    itself be inside an event loop). Started on first use, and again in a forked child,
    which has the loop but not its thread."""

    __slots__ = ("_lock", "_loop", "_pid")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="saga-otel-blocking-tools", daemon=True
                ).start()
                self._loop, self._pid = loop, os.getpid()
            return self._loop

    def run(self, call: Awaitable[T]) -> T:
        """Wait for ``call`` on the loop. It runs in a copy of the caller's context (the
        saga's current_call(), so the undo's idempotency key and call id), as asyncio
        gives a task made from another thread."""

        async def awaited() -> T:
            return await call

        future = asyncio.run_coroutine_threadsafe(awaited(), self.loop())
        try:
            return future.result()
        except BaseException:
            future.cancel()  # an interrupt while waiting: the call stops too
            raise


_BACKGROUND = _Background()


def _blocking(fn: Callable[..., Any]) -> Callable[..., Any]:
    if not is_async_callable(fn):
        return fn

    def call(**kwargs: Any) -> Any:
        return _BACKGROUND.run(fn(**kwargs))

    call.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    call.__name__ = getattr(fn, "__name__", "tool")
    return call


def blocking(registry: ToolRegistry) -> ToolRegistry:
    """``registry`` with each async function (a tool's, a snapshot's) made a blocking one
    that runs it on a background event loop: what a sync unwind (``recover``) can call."""
    out = ToolRegistry()
    for name in registry:
        t = registry.get(name)
        snapshot = _blocking(t.snapshot) if t.snapshot is not None else None
        out.register(replace(t, fn=_blocking(t.fn), snapshot=snapshot), name=name)
    return out


def by_name(tools: Iterable[T], kind: type, what: str, fix: str) -> dict[str, T]:
    """The framework's tool objects by name, refusing anything else with ``fix``, and two
    tools under one name (one would be dropped, its declaration applied to the other)."""
    named: dict[str, T] = {}
    for t in tools:
        if not isinstance(t, kind):
            raise ConfigurationError(f"{t!r} is not a {what}: {fix}")
        name = getattr(t, "name")  # noqa: B009 - every framework tool has a name
        if name in named:
            raise ConfigurationError(
                f"two tools are named {name!r}: the model tells tools apart by name, so one "
                "would be dropped; give each its own name"
            )
        named[name] = t
    return named


def outside_call_id(name: str) -> str:
    """The call id a framework sees for an undo or a snapshot: no model asked for it, so
    the saga's own stable key for the call (``<run>:<step>:compensate``); a snapshot,
    taken before the do's call begins, gets ``saga-otel:<tool>``."""
    call = current_call()
    return call.idempotency_key if call is not None else f"saga-otel:{name}"


@dataclass(frozen=True, slots=True)
class _Flight:
    """The model's call in flight: the tool's name, its run through the framework with the
    agent's context, and the exceptions the user's tools raised during it (the call, a
    snapshot), told apart by identity from the saga's own errors."""

    name: str
    through: Callable[[], Awaitable[Any]]
    raised: list[BaseException] = field(default_factory=list)

    async def watch(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except BaseException as exc:
            self.raised.append(exc)
            raise


# Set by a bound tool around run.call, read by the registry tool's function.
_in_flight: contextvars.ContextVar[_Flight | None] = contextvars.ContextVar(
    "saga_otel_adapter_call", default=None
)


ToolsIn = TypeVar("ToolsIn")
FrameworkTool = TypeVar("FrameworkTool")


class DeclaredTools(Generic[ToolsIn, FrameworkTool]):
    """What each framework's ``SagaTools`` shares: its constructor, rows, registry and review.

    A subclass says where its tools come from (:meth:`collect`, :attr:`where`),
    how to read a tool's parameters (:meth:`params`) and how to call one
    through the framework when no agent asked for it (:meth:`invoke`: an undo
    during an unwind or a recovery, or a snapshot). The model's own calls
    reach the registry tool through :meth:`model_call`, which runs them
    through the framework with the agent's context instead.
    """

    where: str = "the tools"

    def __init__(
        self,
        tools: ToolsIn,
        declare: Mapping[str, Declare] | None = None,
        *,
        unannotated: Unannotated = "refuse",
        unwind_on_tool_error: bool = False,
    ) -> None:
        self.tools: dict[str, FrameworkTool] = self.collect(tools)
        self.unwind_on_tool_error = unwind_on_tool_error
        declared = dict(declare or {})
        self.mappings: tuple[ToolMapping, ...] = classified(
            [Described(n) for n in self.tools],
            declared,
            unannotated=unannotated,
            where=self.where,
        )
        for row in self.mappings:
            for other in (row.undo, row.snapshot):
                if other is not None:
                    self.check_outside(other, row.name)
        self.registry: ToolRegistry = build_registry(
            self.mappings,
            declared,
            call=self._call,
            params=self.params,
            snapshot=self._snapshot,
        )

    def collect(self, tools: ToolsIn) -> dict[str, FrameworkTool]:
        raise NotImplementedError

    def params(self, name: str) -> list[str]:
        raise NotImplementedError

    async def invoke(self, name: str, kwargs: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def check_outside(self, name: str, user: str) -> None:
        """Refuse, at start, a tool that cannot run without the agent (``name`` undoes
        or snapshots ``user``)."""

    def review(self) -> str:
        """Each tool's class, pivot and undo, for a person to check before the agent runs."""
        return review(self.mappings)

    def blocking_registry(self) -> ToolRegistry:
        """:attr:`registry` as blocking functions, for ``recover`` and ``saga-otel recover``
        (a sync unwind): each undo runs through the framework, as in an unwind, on an
        event loop held on a background thread, and blocks until it ends."""
        return blocking(self.registry)

    @staticmethod
    async def model_call(
        name: str,
        run_call: Awaitable[T],
        through: Callable[[], Awaitable[Any]],
        *,
        on_tool_error: Callable[[Exception], Awaitable[T]] | None = None,
    ) -> T:
        """Await ``run_call`` (``run.call(name, ...)``) with the framework's own call
        of the tool, with the agent's context, as what the registry tool runs.

        ``on_tool_error`` answers an exception the user's tool raised (the call or its
        snapshot); the saga's own errors (an undo that could not be stored, a refused
        call) always propagate: they are not the model's to retry.
        """
        flight = _Flight(name, through)
        token = _in_flight.set(flight)
        try:
            return await run_call
        except Exception as exc:
            if on_tool_error is None or not any(exc is e for e in flight.raised):
                raise
            return await on_tool_error(exc)
        finally:
            _in_flight.reset(token)

    def _call(self, name: str) -> Callable[..., Any]:
        async def call(**kwargs: Any) -> Any:
            flight = _in_flight.get()
            if flight is not None and flight.name == name:
                # The model's call, with the agent's context.
                return await flight.watch(flight.through())
            return await self.invoke(name, kwargs)  # an undo: no agent, a context built for it

        call.__signature__ = keyed_signature(self.params(name))  # type: ignore[attr-defined]
        call.__name__ = name
        return call

    def _snapshot(self, name: str) -> Callable[..., Any]:
        wanted = set(self.params(name))

        async def snap(**kwargs: Any) -> Any:
            read = self.invoke(name, {k: v for k, v in kwargs.items() if k in wanted})
            flight = _in_flight.get()
            return await (read if flight is None else flight.watch(read))

        return snap
