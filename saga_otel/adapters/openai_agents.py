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
  ``async with saga.run()``; so does cancelling the task;
* only the tool's own exceptions (its call, its snapshot) go to the model: the
  saga's errors (an undo that could not be stored after the write ran, a call
  the pivot rules refuse) escape ``Runner.run``, wrapped by the SDK, and unwind.

Undos and snapshots run through the tool's own ``on_invoke_tool`` (the SDK
parses the JSON arguments, validates and coerces them with the tool's schema,
and calls the function), with its error handling off, so a failing undo is a
failed compensation, never a message. No agent runs during an unwind, so the
``ToolContext`` is built for the call: ``context`` None, the compensation's
idempotency key as ``tool_call_id``. An undo must not take a context (checked
at start for ``@function_tool`` functions).

``tools.blocking_registry()`` is the registry ``saga-otel recover`` needs (its
unwind is sync): the same undos, through the framework, as blocking functions.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Any

try:
    from agents import FunctionTool, Usage
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

from saga_otel import ConfigurationError, Run, tool_call_id
from saga_otel.adapters._declare import (
    Declare,
    DeclaredTools,
    ToolErrorUnwind,
    ToolMapping,
    by_name,
    outside_call_id,
)

__all__ = ["Declare", "SagaTools", "ToolErrorUnwind", "ToolMapping"]


def _strict(t: FunctionTool) -> FunctionTool:
    """A copy whose failures raise: the saga must see them (the bound tool formats them)."""
    return set_function_tool_failure_error_function(copy.copy(t), None)


class SagaTools(DeclaredTools[Sequence[FunctionTool], FunctionTool]):
    """The agent's function tools as a :class:`~saga_otel.ToolRegistry`, bound per run.

    ``SagaTools(tools, declare, *, unannotated="refuse", unwind_on_tool_error=False)``.
    """

    where = "the agent's function tools"

    def collect(self, tools: Sequence[FunctionTool]) -> dict[str, FunctionTool]:
        named = by_name(tools, FunctionTool, "FunctionTool", "wrap it with agents.function_tool")
        self.strict = {name: _strict(t) for name, t in named.items()}
        return named

    def params(self, name: str) -> list[str]:
        return list((self.tools[name].params_json_schema.get("properties") or {}).keys())

    def check_outside(self, name: str, user: str) -> None:
        fn = getattr(self.tools[name], "__wrapped__", None)  # the @function_tool function
        params = list(inspect.signature(fn).parameters.values()) if callable(fn) else []
        if params and "Context" in str(params[0].annotation):
            raise ConfigurationError(
                f"tool {name!r} undoes or snapshots {user!r} but takes a context; an undo runs "
                "without the agent (unwind, recovery): give it no context parameter"
            )

    async def invoke(self, name: str, kwargs: Mapping[str, Any]) -> Any:
        """The tool's own ``on_invoke_tool``, with a ``ToolContext`` built for the call."""
        input_json = json.dumps(dict(kwargs))
        ctx: ToolContext[Any] = ToolContext(
            context=None,
            usage=Usage(),
            tool_name=name,
            tool_call_id=outside_call_id(name),
            tool_arguments=input_json,
        )
        return await self.strict[name].on_invoke_tool(ctx, input_json)

    def bind(self, run: Run) -> list[FunctionTool]:
        """Copies of the tools, for ``Agent(tools=...)``, whose calls go through ``run``."""
        bound: list[FunctionTool] = []
        for t in self.tools.values():
            copied = copy.copy(t)
            copied.on_invoke_tool = _invoker(t, self.strict[t.name], run, self)
            bound.append(copied)
        return bound


def _invoker(t: FunctionTool, strict: FunctionTool, run: Run, tools: SagaTools) -> Any:
    name = t.name

    async def invoke(ctx: ToolContext[Any], input_json: str) -> Any:
        try:
            args = json.loads(input_json or "{}")
        except ValueError:
            args = None
        if not isinstance(args, dict):
            args = {}  # the SDK's pipeline reports the bad JSON to the model as the tool's error

        async def through() -> Any:  # the SDK's own pipeline, with the agent's context
            return await strict.on_invoke_tool(ctx, input_json)

        async def tool_error(exc: Exception) -> Any:  # the tool's own error, not the saga's
            if tools.unwind_on_tool_error:
                raise ToolErrorUnwind.of(name, exc) from exc
            # As the SDK would: the tool's failure_error_function makes the model's message.
            message = await maybe_invoke_function_tool_failure_error_function(
                function_tool=t, context=ctx, error=exc
            )
            if message is None:
                raise exc
            return message

        with tool_call_id(ctx.tool_call_id):
            return await tools.model_call(
                name, run.call(name, **args), through, on_tool_error=tool_error
            )

    return invoke
