"""OpenAI Agents SDK function tools as saga steps: ``pip install 'saga-otel[openai-agents]'``.

:class:`SagaTools` takes the agent's ``FunctionTool`` objects (``@function_tool``)
and the user's :class:`Declare` per tool name. ``tools.bind(run)`` returns copies
to give ``Agent(tools=...)`` for one run: the SDK still parses and validates
the arguments and injects the context, and each call runs as ``run.call`` with
the SDK's ``tool_call_id`` as ``gen_ai.tool.call.id``.

Failure semantics (docs/frameworks.md). The SDK hands a tool's exception back
to the model as a message by default (the tool's ``failure_error_function``):

* so, by default, a tool that raises is a failed step and the run goes on; with
  ``unwind_on_tool_error=True`` :class:`ToolErrorUnwind` escapes
  ``Runner.run`` instead and the run unwinds;
* a tool made with ``failure_error_function=None`` lets its exception escape
  ``Runner.run``, and any failure escaping the run (``MaxTurnsExceeded``, a
  guardrail tripwire, the model's own error) unwinds when it leaves
  ``async with saga.run()``; so does cancelling the task.

Undos run without the agent: the undo tool's Python function (``__wrapped__``)
is called with the undo's arguments, so it must not take a context parameter.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

try:
    from agents import FunctionTool
    from agents.tool import (
        maybe_invoke_function_tool_failure_error_function,
        set_function_tool_failure_error_function,
    )
    from agents.tool_context import ToolContext
except ImportError as exc:  # pragma: no cover - exercised by the library-only install
    raise ImportError(
        "saga_otel.adapters.openai_agents needs the OpenAI Agents SDK: "
        "pip install 'saga-otel[openai-agents]'"
    ) from exc

from saga_otel import ConfigurationError, Run, Tool, ToolRegistry, tool_call_id
from saga_otel.adapters._declare import (
    Declare,
    Described,
    ToolErrorUnwind,
    ToolMapping,
    Unannotated,
    describe,
    map_declared,
    refusal,
    review,
    undo_recipe,
)

__all__ = ["Declare", "SagaTools", "ToolErrorUnwind", "ToolMapping"]

# (tool name, ToolContext, input JSON) of the model's call in flight, for the registry tool.
_forward: contextvars.ContextVar[tuple[str, Any, str] | None] = contextvars.ContextVar(
    "saga_otel_openai_agents_forward", default=None
)


def _raw(t: FunctionTool) -> Callable[..., Any]:
    """The Python function behind ``@function_tool``; an undo must have one and take no context."""
    try:
        fn: Callable[..., Any] = t.__wrapped__
    except AttributeError:
        raise ConfigurationError(
            f"tool {t.name!r} undoes or snapshots another but is not a @function_tool "
            "function: an undo is called without the agent, so it must be one"
        ) from None
    params = list(inspect.signature(fn).parameters.values())
    if params and "Context" in str(params[0].annotation):
        raise ConfigurationError(
            f"tool {t.name!r} undoes or snapshots another but takes a context; an undo runs "
            "without the agent (unwind, recovery): give it no context parameter"
        )
    return fn


def _params(t: FunctionTool) -> list[str]:
    return list((t.params_json_schema.get("properties") or {}).keys())


async def _call_raw(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
    out = fn(**kwargs)
    return await out if inspect.isawaitable(out) else out


class SagaTools:
    """The agent's function tools as a :class:`~saga_otel.ToolRegistry`, bound per run."""

    def __init__(
        self,
        tools: Sequence[FunctionTool],
        declare: Mapping[str, Declare] | None = None,
        *,
        unannotated: Unannotated = "refuse",
        unwind_on_tool_error: bool = False,
    ) -> None:
        self.tools: dict[str, FunctionTool] = {}
        for t in tools:
            if not isinstance(t, FunctionTool):
                raise ConfigurationError(
                    f"{t!r} is not a FunctionTool: wrap it with agents.function_tool"
                )
            self.tools[t.name] = t
        self.unwind_on_tool_error = unwind_on_tool_error
        declare = dict(declare or {})
        self.mappings: tuple[ToolMapping, ...] = tuple(
            map_declared(
                [Described(name) for name in self.tools],
                declare,
                unannotated=unannotated,
                where="the agent's function tools",
            )
        )
        refused = refusal(self.mappings)
        if refused is not None:
            raise ConfigurationError(refused)
        self.registry = ToolRegistry()
        for row in self.mappings:
            assert row.step_class is not None
            d = declare.get(row.name, Declare())
            if row.undo:
                _raw(self.tools[row.undo])  # checked now: an undo runs without the agent
            self.registry.register(
                Tool(
                    name=row.name,
                    fn=self._caller(self.tools[row.name]),
                    step_class=row.step_class,
                    compensate=row.undo,
                    compensate_args=(
                        undo_recipe(d.undo_args, _params(self.tools[row.undo]))
                        if row.undo
                        else None
                    ),
                    describe=describe(d),
                    snapshot=_snapshotter(self.tools[row.snapshot]) if row.snapshot else None,
                    retry=d.retry,
                    pivot=row.pivot,
                )
            )
        self.registry.check_compensations()

    @staticmethod
    def _caller(t: FunctionTool) -> Callable[..., Any]:
        # A copy whose failures raise: the saga must see them (the bound tool formats them).
        strict = set_function_tool_failure_error_function(copy.copy(t), None)
        name = t.name

        async def call(**kwargs: Any) -> Any:
            forward = _forward.get()
            if forward is not None and forward[0] == name:
                # The model's call: the SDK's own pipeline (parsing, validation, context).
                return await strict.on_invoke_tool(forward[1], forward[2])
            return await _call_raw(_raw(t), kwargs)  # an undo, during an unwind or a recovery

        call.__signature__ = inspect.Signature()  # type: ignore[attr-defined]
        call.__name__ = name
        return call

    def review(self) -> str:
        """Each tool's class, pivot and undo, for a person to check before the agent runs."""
        return review(self.mappings)

    def bind(self, run: Run) -> list[FunctionTool]:
        """Copies of the tools, for ``Agent(tools=...)``, whose calls go through ``run``."""
        bound: list[FunctionTool] = []
        for t in self.tools.values():
            copied = copy.copy(t)
            copied.on_invoke_tool = _invoker(t, run, self.unwind_on_tool_error)
            bound.append(copied)
        return bound


def _snapshotter(t: FunctionTool) -> Callable[..., Any]:
    fn, wanted = _raw(t), set(_params(t))

    async def snap(**kwargs: Any) -> Any:
        return await _call_raw(fn, {k: v for k, v in kwargs.items() if k in wanted})

    return snap


def _invoker(t: FunctionTool, run: Run, unwind_on_tool_error: bool) -> Any:
    name = t.name

    async def invoke(ctx: ToolContext[Any], input_json: str) -> Any:
        try:
            args = json.loads(input_json or "{}")
        except ValueError:
            args = None
        if not isinstance(args, dict):
            args = {}  # the SDK's pipeline reports the bad JSON to the model as the tool's error
        token = _forward.set((name, ctx, input_json))
        try:
            with tool_call_id(ctx.tool_call_id):
                return await run.call(name, **args)
        except Exception as exc:
            if unwind_on_tool_error:
                raise ToolErrorUnwind(
                    f"tool {name!r} failed ({exc}) and unwind_on_tool_error is set"
                ) from exc
            # As the SDK would: the tool's failure_error_function makes the model's message.
            message = await maybe_invoke_function_tool_failure_error_function(
                function_tool=t, context=ctx, error=exc
            )
            if message is None:
                raise
            return message
        finally:
            _forward.reset(token)

    return invoke
