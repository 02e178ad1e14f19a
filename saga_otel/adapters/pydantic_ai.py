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

Undos run without the agent: during an unwind (or a recovery) the undo tool's
plain function is called, so an undo must not take a ``RunContext``.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

try:
    from pydantic_ai import ModelRetry, RunContext
    from pydantic_ai import Tool as PaiTool
    from pydantic_ai.toolsets import AbstractToolset, FunctionToolset, WrapperToolset
    from pydantic_ai.toolsets.abstract import ToolsetTool
except ImportError as exc:  # pragma: no cover - exercised by the library-only install
    raise ImportError(
        "saga_otel.adapters.pydantic_ai needs pydantic-ai: pip install 'saga-otel[pydantic-ai]'"
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


# (tool name, toolset, ctx, toolset tool) of the model's call in flight, for the registry tool.
_forward: contextvars.ContextVar[tuple[str, Any, Any, Any] | None] = contextvars.ContextVar(
    "saga_otel_pydantic_ai_forward", default=None
)


def _params(t: PaiTool[Any]) -> list[str]:
    names = list(inspect.signature(t.function).parameters)
    return names[1:] if t.takes_ctx else names


async def _plain(t: PaiTool[Any], kwargs: Mapping[str, Any]) -> Any:
    fn: Callable[..., Any] = t.function  # an undo takes no RunContext (checked at start)
    out = fn(**kwargs)
    return await out if inspect.isawaitable(out) else out


class SagaTools:
    """The agent's tools as a :class:`~saga_otel.ToolRegistry` and a toolset bound per run."""

    def __init__(
        self,
        tools: FunctionToolset[Any] | Sequence[PaiTool[Any] | Callable[..., Any]],
        declare: Mapping[str, Declare] | None = None,
        *,
        unannotated: Unannotated = "refuse",
        unwind_on_tool_error: bool = False,
    ) -> None:
        self.wrapped: FunctionToolset[Any] = (
            tools if isinstance(tools, FunctionToolset) else FunctionToolset(list(tools))
        )
        self.unwind_on_tool_error = unwind_on_tool_error
        by_name: dict[str, PaiTool[Any]] = dict(self.wrapped.tools)
        declare = dict(declare or {})
        self.mappings: tuple[ToolMapping, ...] = tuple(
            map_declared(
                [Described(name) for name in by_name],
                declare,
                unannotated=unannotated,
                where="the pydantic-ai toolset",
            )
        )
        refused = refusal(self.mappings)
        if refused is not None:
            raise ConfigurationError(refused)
        for row in self.mappings:
            for other in (row.undo, row.snapshot):
                if other is not None and by_name[other].takes_ctx:
                    raise ConfigurationError(
                        f"tool {other!r} undoes or snapshots {row.name!r} but takes a "
                        "RunContext; an undo runs without the agent (unwind, recovery): "
                        "register it with tool_plain, or give it no ctx parameter"
                    )
        self.registry = ToolRegistry()
        for row in self.mappings:
            assert row.step_class is not None
            d = declare.get(row.name, Declare())
            self.registry.register(
                Tool(
                    name=row.name,
                    fn=self._caller(by_name[row.name]),
                    step_class=row.step_class,
                    compensate=row.undo,
                    compensate_args=(
                        undo_recipe(d.undo_args, _params(by_name[row.undo])) if row.undo else None
                    ),
                    describe=describe(d),
                    snapshot=self._snapshotter(by_name[row.snapshot]) if row.snapshot else None,
                    retry=d.retry,
                    pivot=row.pivot,
                )
            )
        self.registry.check_compensations()

    def _caller(self, t: PaiTool[Any]) -> Callable[..., Any]:
        name = t.name

        async def call(**kwargs: Any) -> Any:
            forward = _forward.get()
            if forward is not None and forward[0] == name:
                # The model's call: through pydantic-ai, with its RunContext and validation.
                _, toolset, ctx, tool = forward
                return await toolset.call_tool(name, kwargs, ctx, tool)
            return await _plain(t, kwargs)  # an undo, during an unwind or a recovery

        # No parameters the engine could fill: a tool that wants the saga's idempotency
        # key reads saga_otel.current_call().idempotency_key (the model never sees it).
        call.__signature__ = inspect.Signature()  # type: ignore[attr-defined]
        call.__name__ = name
        return call

    @staticmethod
    def _snapshotter(t: PaiTool[Any]) -> Callable[..., Any]:
        wanted = set(_params(t))

        async def snap(**kwargs: Any) -> Any:
            return await _plain(t, {k: v for k, v in kwargs.items() if k in wanted})

        return snap

    def review(self) -> str:
        """Each tool's class, pivot and undo, for a person to check before the agent runs."""
        return review(self.mappings)

    def toolset(self, run: Run) -> AbstractToolset[Any]:
        """The toolset to give ``agent.run(..., toolsets=[...])`` for this run."""
        return _SagaToolset(self.wrapped, run, self.unwind_on_tool_error)


@dataclass
class _SagaToolset(WrapperToolset[Any]):
    run: Run = None  # type: ignore[assignment]
    unwind_on_tool_error: bool = False

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        token = _forward.set((name, self.wrapped, ctx, tool))
        try:
            with tool_call_id(ctx.tool_call_id):
                return await self.run.call(name, **tool_args)
        except ModelRetry as exc:
            if self.unwind_on_tool_error:
                raise ToolErrorUnwind(
                    f"tool {name!r} failed ({exc}) and unwind_on_tool_error is set"
                ) from exc
            raise  # pydantic-ai hands the message back to the model
        finally:
            _forward.reset(token)
