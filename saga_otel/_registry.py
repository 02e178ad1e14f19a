"""Tools: what they do to the world, and how the undo of each call is built.

A :class:`Tool` wraps a plain function (sync or async) with its step class and
the recipe for its compensation. The recipe runs the moment the do succeeds,
with the do's own arguments and result (and, for a read-then-write tool, the
value read before the write), and yields a :class:`Compensation` record naming
another tool. A :class:`ToolRegistry` resolves names to tools, so the record can
be run by a process that never saw the forward call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

from saga_otel._errors import ConfigurationError, UnknownToolError
from saga_otel._frozen import fast_init
from saga_otel._outcome import is_async_callable, is_generator_callable
from saga_otel.records import Compensation, RetryPolicy, StepClass, describe_error

IDEMPOTENCY_PARAM = "idempotency_key"


@fast_init
@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a compensation recipe sees: the call's arguments, its result, its snapshot."""

    tool: str
    args: Mapping[str, Any]
    result: Any
    snapshot: Any = None
    run_id: str = ""
    index: int = -1


ArgsRecipe = Callable[[CallInfo], Mapping[str, Any]]
DescribeRecipe = str | Callable[[CallInfo], str]


def _default_args(info: CallInfo) -> Mapping[str, Any]:
    return {"snapshot": info.snapshot} if info.snapshot is not None else dict(info.args)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function with a declared step class and, for writes, its undo recipe."""

    name: str
    fn: Callable[..., Any]
    step_class: StepClass
    compensate: str | None = None
    compensate_args: ArgsRecipe | None = None
    describe: DescribeRecipe | None = None
    snapshot: Callable[..., Any] | None = None
    validate: Callable[..., Any] | None = None
    retry: RetryPolicy | None = None
    pivot: bool = False
    accepts_idempotency_key: bool = field(default=False, compare=False)
    _is_async: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.step_class.pushes and self.compensate is None:
            raise ConfigurationError(
                f"tool {self.name!r} is {self.step_class.value} but names no compensation: "
                "pass compensate='<tool that undoes it>' (or declare it convergent/irreversible)"
            )
        if not self.step_class.pushes and self.compensate is not None:
            raise ConfigurationError(
                f"tool {self.name!r} is {self.step_class.value}, which pushes nothing, yet names "
                f"compensate={self.compensate!r}: declare it reversible or compensable"
            )
        if self.snapshot is not None and self.step_class is not StepClass.REVERSIBLE:
            raise ConfigurationError(
                f"tool {self.name!r} has a snapshot reader but is {self.step_class.value}: "
                "read-then-write is for reversible tools"
            )
        if is_generator_callable(self.fn):
            raise ConfigurationError(
                f"tool {self.name!r} is a generator function (it yields): calling it runs "
                "none of its body, so its write would be recorded done without happening. "
                "Return the result instead of yielding it"
            )
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):  # builtins without a signature
            params = {}  # type: ignore[assignment]
        accepts = IDEMPOTENCY_PARAM in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )
        object.__setattr__(self, "accepts_idempotency_key", accepts)
        object.__setattr__(self, "_is_async", is_async_callable(self.fn))

    @property
    def is_async(self) -> bool:
        return self._is_async

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Calling a Tool directly runs the bare function, outside any saga.
        return self.fn(*args, **kwargs)

    def build_compensation(self, info: CallInfo, *, step: str) -> Compensation | None:
        """Capture the undo now, from this call's own references."""
        if self.compensate is None:
            return None
        recipe = self.compensate_args or _default_args
        args = recipe(info)
        if isinstance(self.describe, str):
            description = describe_text(self.describe, info, args)
        elif callable(self.describe):
            # The do ran: its undo is never lost for its description, which falls back.
            try:
                description = self.describe(info)
                if not isinstance(description, str):
                    raise TypeError(f"describe returned a {type(description).__name__}, not a str")
            except Exception as exc:
                description = _not_built(_plain(self.compensate, args), exc)
        else:
            description = _plain(self.compensate, args)
        return Compensation(
            tool=self.compensate, args=args, description=description, step=step, index=info.index
        )


def describe_text(template: str, info: CallInfo, args: Mapping[str, Any]) -> str:
    """A ``describe`` template formatted with the do's arguments, the undo's and ``result``.

    Any failure (a field the call lacks, a result that is not subscriptable, a bad format
    spec) gives the template itself, saying why: the do ran, and its undo must never be
    lost for its description.
    """
    try:
        return template.format(**{**dict(info.args), **dict(args), "result": info.result})
    except Exception as exc:
        return _not_built(template, exc)


def _plain(undo: str, args: Mapping[str, Any]) -> str:
    """The undo's call, for a step with no description of its own."""
    return f"{undo}({', '.join([f'{k}={v!r}' for k, v in args.items()])})"


def _not_built(fallback: str, exc: Exception) -> str:
    why = describe_error(exc)
    return f"{fallback} (description not built: {why if len(why) <= 200 else why[:199] + '…'})"


def _make_tool(
    fn: Callable[..., Any],
    step_class: StepClass | str,
    *,
    name: str | None,
    compensate: str | None,
    compensate_args: ArgsRecipe | None,
    describe: DescribeRecipe | None,
    snapshot: Callable[..., Any] | None,
    validate: Callable[..., Any] | None,
    retry: RetryPolicy | None,
    pivot: bool,
) -> Tool:
    return Tool(
        name=name or fn.__name__,
        fn=fn,
        step_class=StepClass.parse(step_class),
        compensate=compensate,
        compensate_args=compensate_args,
        describe=describe,
        snapshot=snapshot,
        validate=validate,
        retry=retry,
        pivot=pivot,
    )


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    step_class: StepClass | str = ...,
    /,
    *,
    name: str | None = ...,
    compensate: str | None = ...,
    compensate_args: ArgsRecipe | None = ...,
    describe: DescribeRecipe | None = ...,
    snapshot: Callable[..., Any] | None = ...,
    validate: Callable[..., Any] | None = ...,
    retry: RetryPolicy | None = ...,
    pivot: bool = ...,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    step_class: StepClass | str | Callable[..., Any] = StepClass.READ,
    /,
    *,
    name: str | None = None,
    compensate: str | None = None,
    compensate_args: ArgsRecipe | None = None,
    describe: DescribeRecipe | None = None,
    snapshot: Callable[..., Any] | None = None,
    validate: Callable[..., Any] | None = None,
    retry: RetryPolicy | None = None,
    pivot: bool = False,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Declare a tool: ``@tool("compensable", compensate="reverse_credit", ...)``.

    ``compensate_args(info)`` builds the undo's arguments from the call's
    references (``info.result``, ``info.args``, ``info.snapshot``). ``snapshot``
    makes a reversible tool read-then-write: it is called with the same
    arguments before the write, its value deep-copied as read (a write that
    mutates the object returned does not change it), and by default the undo
    receives ``snapshot=<that value>``. ``describe`` is the undo's description
    for people: a template formatted with the do's arguments, the undo's and
    ``result``, or a function of the call; one that cannot be built falls back
    (the template, or the undo's call) saying why, and the undo is kept.
    ``retry`` is this tool's policy when it runs as a compensation.
    ``validate`` is a dry run called before the saga's first do. A bare
    ``@tool`` declares a read.
    """
    if callable(step_class) and not isinstance(step_class, str):  # bare @tool
        return tool(StepClass.READ, name=name, validate=validate, retry=retry)(step_class)
    cls = step_class

    def decorate(fn: Callable[..., Any]) -> Tool:
        return _make_tool(
            fn,
            cls,
            name=name,
            compensate=compensate,
            compensate_args=compensate_args,
            describe=describe,
            snapshot=snapshot,
            validate=validate,
            retry=retry,
            pivot=pivot,
        )

    return decorate


class ToolRegistry:
    """Tools by name. Read-only once built is the intended use; runs never mutate it."""

    __slots__ = ("_tools",)

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.register(t)

    def register(self, t: Tool | Callable[..., Any], *, name: str | None = None) -> Tool:
        """Add a tool (a plain function is registered as a convergent write)."""
        if not isinstance(t, Tool):
            t = _make_tool(
                t,
                StepClass.CONVERGENT,
                name=name,
                compensate=None,
                compensate_args=None,
                describe=None,
                snapshot=None,
                validate=None,
                retry=None,
                pivot=False,
            )
        key = name or t.name
        if key in self._tools and self._tools[key] is not t:
            raise ConfigurationError(
                f"tool name {key!r} is already registered: give the second tool another name"
            )
        self._tools[key] = t
        return t

    def tool(self, *args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Tool]:
        """``@registry.tool("compensable", compensate=...)``: declare and register."""

        def decorate(fn: Callable[..., Any]) -> Tool:
            made = tool(*args, **kwargs)(fn) if args or kwargs else tool(fn)
            assert isinstance(made, Tool)
            return self.register(made)

        return decorate

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            known = ", ".join(sorted(self._tools)) or "none"
            raise UnknownToolError(
                f"no tool named {name!r} in this registry (known: {known}); register it "
                "with ToolRegistry.register() or @registry.tool(...)"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def check_compensations(self) -> None:
        """Fail fast when a tool names an undo that is not registered."""
        for t in self._tools.values():
            if t.compensate is not None and t.compensate not in self._tools:
                raise UnknownToolError(
                    f"tool {t.name!r} is undone by {t.compensate!r}, which is not registered; "
                    "register the compensation tool in the same registry"
                )
