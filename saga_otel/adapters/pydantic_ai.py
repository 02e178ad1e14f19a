"""pydantic-ai tools as saga steps: ``pip install 'saga-otel[pydantic-ai]'``.

:class:`SagaTools` takes the agent's tools (a ``FunctionToolset``, or a list of
``pydantic_ai.Tool`` objects and functions) and the user's :class:`Declare` per
tool name (pydantic-ai tools carry no class of their own). ``tools.toolset(run)``
is a toolset to pass to ``agent.run(..., toolsets=[...])``: each call the model
makes runs as ``run.call`` with the model's ``tool_call_id`` as
``gen_ai.tool.call.id``, and pydantic-ai still validates the arguments, passes
the ``RunContext`` and handles retries.

Failure semantics (docs/frameworks.md):

* a tool raising ``ModelRetry`` is a failed step whose message pydantic-ai hands
  back to the model; the run goes on, unless ``unwind_on_tool_error=True``
  (then :class:`ToolErrorUnwind` escapes ``agent.run`` and the run unwinds);
* any other exception escapes ``agent.run`` (pydantic-ai does not catch it),
  and leaving ``async with saga.run()`` with it unwinds; so does
  ``UnexpectedModelBehavior`` (for instance retries exhausted);
* cancelling the task running the agent unwinds, shielded.

Undos and snapshots run through pydantic-ai's own tool call path (a
``ToolManager`` over the same toolset holding that one tool, so no other tool's
``prepare`` runs: the tool's ``prepare``, its argument schema and
``args_validator``, its timeout) with a ``RunContext`` built for
them, since no agent step exists during an unwind: ``deps`` None, a model that
refuses to be asked, the compensation's idempotency key as ``tool_call_id``. So
an undo must not take a ``RunContext`` (checked at start).

``tools.blocking_registry()`` is the registry ``saga-otel recover`` needs (its
unwind is sync): the same undos, through the framework, as blocking functions.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

try:
    from pydantic_ai import ModelRetry, RunContext, RunUsage, ToolDenied
    from pydantic_ai import Tool as PaiTool
    from pydantic_ai.messages import ModelMessage, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    from pydantic_ai.tool_manager import ToolManager
    from pydantic_ai.toolsets import AbstractToolset, FunctionToolset, WrapperToolset
    from pydantic_ai.toolsets.abstract import ToolsetTool
except ImportError as exc:  # pragma: no cover - exercised by the library-only install
    raise ImportError(
        "saga_otel.adapters.pydantic_ai needs pydantic-ai: pip install 'saga-otel[pydantic-ai]'"
    ) from exc

from saga_otel import ConfigurationError, Run, SagaError, tool_call_id
from saga_otel.adapters._declare import (
    Declare,
    DeclaredTools,
    ToolErrorUnwind,
    ToolMapping,
    outside_call_id,
)

__all__ = ["Declare", "SagaTools", "ToolErrorUnwind", "ToolMapping"]


def _no_model(_messages: list[ModelMessage], _info: AgentInfo) -> NoReturn:
    raise ConfigurationError(
        "an undo or snapshot asked the model: during an unwind there is no agent run; "
        "make the tool call no model (no ctx.model, no sub-agent)"
    )


# The RunContext's model for calls made without the agent: a real model that refuses.
_UNWIND_MODEL = FunctionModel(_no_model, model_name="saga-otel-unwind")


PaiTools = FunctionToolset[Any] | Sequence[PaiTool[Any] | Callable[..., Any]]


def _alone(toolset: FunctionToolset[Any], name: str) -> FunctionToolset[Any]:
    """The toolset as it is (its class, retries, timeout) holding the one tool ``name``,
    for an undo or a snapshot: only that tool's ``prepare`` runs. Another tool's may read
    the agent's deps, which no unwind has, and would fail every undo."""
    view = copy.copy(toolset)
    view.tools = {name: toolset.tools[name]}
    return view


class SagaTools(DeclaredTools[PaiTools, PaiTool[Any]]):
    """The agent's tools as a :class:`~saga_otel.ToolRegistry` and a toolset bound per run.

    ``SagaTools(tools, declare, *, unannotated="refuse", unwind_on_tool_error=False)``:
    ``tools`` is a ``FunctionToolset``, or a list of ``Tool`` objects and functions.
    """

    where = "the pydantic-ai toolset"

    def collect(self, tools: PaiTools) -> dict[str, PaiTool[Any]]:
        self.wrapped: FunctionToolset[Any] = (
            tools if isinstance(tools, FunctionToolset) else FunctionToolset(list(tools))
        )
        self.alone = {name: _alone(self.wrapped, name) for name in self.wrapped.tools}
        return dict(self.wrapped.tools)

    def params(self, name: str) -> list[str]:
        return list(self.tools[name].function_schema.json_schema.get("properties") or {})

    def check_outside(self, name: str, user: str) -> None:
        if self.tools[name].takes_ctx:
            raise ConfigurationError(
                f"tool {name!r} undoes or snapshots {user!r} but takes a RunContext; an undo "
                "runs without the agent (unwind, recovery): register it with tool_plain, or "
                "give it no ctx parameter"
            )

    async def invoke(self, name: str, kwargs: Mapping[str, Any]) -> Any:
        """The tool through pydantic-ai's own call path, with a context built for it."""
        ctx: RunContext[Any] = RunContext(deps=None, model=_UNWIND_MODEL, usage=RunUsage())
        manager = await ToolManager[Any](self.alone[name]).for_run_step(ctx)
        call = ToolCallPart(name, dict(kwargs), tool_call_id=outside_call_id(name))
        result = await manager.handle_call(call, wrap_validation_errors=False)
        if isinstance(result, ToolDenied):
            raise SagaError(f"tool {name!r} was denied: {result.message}")
        return result

    def toolset(self, run: Run) -> AbstractToolset[Any]:
        """The toolset to give ``agent.run(..., toolsets=[...])`` for this run."""
        return _SagaToolset(self.wrapped, run, self)


@dataclass
class _SagaToolset(WrapperToolset[Any]):
    run: Run = None  # type: ignore[assignment]
    tools: SagaTools = None  # type: ignore[assignment]

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        async def through() -> Any:  # pydantic-ai's own call, with the agent's RunContext
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)

        try:
            with tool_call_id(ctx.tool_call_id):
                return await self.tools.model_call(name, self.run.call(name, **tool_args), through)
        except ModelRetry as exc:
            if self.tools.unwind_on_tool_error:
                raise ToolErrorUnwind.of(name, exc) from exc
            raise  # pydantic-ai hands the message back to the model
