"""LangChain tools as saga steps, in a LangGraph graph or anywhere: ``saga-otel[langchain]``.

:class:`SagaTools` takes the agent's LangChain tools (any ``BaseTool``: ``@tool``
functions, ``StructuredTool``) and the user's :class:`Declare` per tool name.
``tools.bind(run)`` returns tools with the same names, descriptions, argument
schemas, ``return_direct``, ``response_format`` and error handling to hand to the
model and to LangGraph's ``ToolNode``; each call runs as
``run.call`` with the ``ToolCall``'s id as ``gen_ai.tool.call.id``. They are
async: run the graph with ``ainvoke``/``astream``.

Failure semantics (docs/frameworks.md):

* a ``ToolException`` that the tool's ``handle_tool_error`` turns into a
  ``ToolMessage``, or any error a ``ToolNode(handle_tool_errors=...)`` turns
  into one, is a failed step and the run goes on; with
  ``unwind_on_tool_error=True`` a ``ToolException`` becomes
  :class:`ToolErrorUnwind` instead (which escapes unless a ``ToolNode`` is told
  to catch every error);
* any error that escapes the graph's ``ainvoke`` (``ToolNode``'s default
  re-raises everything but argument errors) unwinds when it leaves
  ``async with saga.run()``; so does cancelling the task.

Undos are called as the original tool, with its own error handling off, so an
undo that fails is a failed compensation, never a string.

``tools.blocking_registry()`` is the registry ``saga-otel recover`` needs (its
unwind is sync): the same undos, through the framework, as blocking functions.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping, Sequence
from typing import Any

try:
    from langchain_core.tools import BaseTool, InjectedToolCallId, ToolException
    from pydantic import BaseModel, create_model
except ImportError as exc:  # pragma: no cover - exercised by the library-only install
    raise ImportError(
        "saga_otel.adapters.langchain needs langchain-core: pip install 'saga-otel[langchain]'"
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

_call_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "saga_otel_langchain_call_id", default=None
)


def _call_id_fields(t: BaseTool) -> tuple[str, ...]:
    """The tool's parameters LangChain fills with the ToolCall's id (``InjectedToolCallId``)."""
    schema = t.args_schema
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        return ()  # LangChain injects the id only through a pydantic schema
    return tuple(
        name
        for name, info in schema.model_fields.items()
        if any(
            isinstance(m, InjectedToolCallId)
            or (isinstance(m, type) and issubclass(m, InjectedToolCallId))
            for m in info.metadata
        )
    )


def _strict(t: BaseTool) -> BaseTool:
    """The tool with its own error handling off: the saga must see its failures.

    The ToolCall's id is an ordinary argument of this copy: LangChain gives it only to a
    tool invoked with a whole ToolCall, whose output it then turns into a message, and
    the saga passes it itself (the model's, or the undo's key).
    """
    update: dict[str, Any] = {
        "handle_tool_error": False,
        "handle_validation_error": False,
        # The function's own output: the bound tool, which keeps the tool's response_format,
        # makes the message (and its artifact) from it.
        "response_format": "content",
    }
    ids = _call_id_fields(t)
    if ids:
        schema = t.args_schema
        assert isinstance(schema, type) and issubclass(schema, BaseModel)
        plain: dict[str, Any] = {name: (str, ...) for name in ids}
        update["args_schema"] = create_model(schema.__name__, __base__=schema, **plain)
    return t.model_copy(update=update)


class SagaTools(DeclaredTools[Sequence[BaseTool], BaseTool]):
    """The agent's LangChain tools as a :class:`~saga_otel.ToolRegistry`, bound per run.

    ``SagaTools(tools, declare, *, unannotated="refuse", unwind_on_tool_error=False)``.
    """

    where = "the LangChain tools"

    def collect(self, tools: Sequence[BaseTool]) -> dict[str, BaseTool]:
        named = by_name(tools, BaseTool, "LangChain tool", "wrap it with langchain_core.tools.tool")
        self.strict = {name: _strict(t) for name, t in named.items()}
        self.call_ids = {name: _call_id_fields(t) for name, t in named.items()}
        return named

    def params(self, name: str) -> list[str]:
        return list(self.tools[name].args)

    async def invoke(self, name: str, kwargs: Mapping[str, Any]) -> Any:
        """The original tool's ``ainvoke``, its own error handling off. LangChain needs no
        agent context, so the model's calls (validated by the bound tool, the ToolCall's
        id injected) come here too; an undo's injected call id is its idempotency key."""
        args = dict(kwargs)
        for field in self.call_ids[name]:
            args.setdefault(field, outside_call_id(name))
        return await self.strict[name].ainvoke(args)

    def bind(self, run: Run) -> list[BaseTool]:
        """Tools to give the model and the ``ToolNode`` for this run."""
        return [
            _SagaTool(
                **_own_fields(t), saga_run=run, unwind_on_tool_error=self.unwind_on_tool_error
            )
            for t in self.tools.values()
        ]


def _own_fields(t: BaseTool) -> dict[str, Any]:
    """The tool's own ``BaseTool`` fields, for its bound copy: what the model sees (name,
    description, schema) and how LangChain reports the call (``return_direct``,
    ``response_format``, ``handle_tool_error``, ``handle_validation_error``, tags...).
    A subclass declaring no ``args_schema`` gets the one LangChain reads from its
    ``_run``; the callbacks stay with the original, which the call runs through."""
    fields = {f: getattr(t, f) for f in BaseTool.model_fields if f != "callbacks"}
    if fields["args_schema"] is None:
        fields["args_schema"] = t.get_input_schema()
    return fields


class _SagaTool(BaseTool):
    """A bound tool: LangChain validates and reports, the saga run calls the original."""

    saga_run: Any
    unwind_on_tool_error: bool = False

    async def arun(self, *args: Any, **kwargs: Any) -> Any:
        token = _call_id.set(kwargs.get("tool_call_id"))
        try:
            return await super().arun(*args, **kwargs)
        finally:
            _call_id.reset(token)

    async def _arun(self, **kwargs: Any) -> Any:
        try:
            with tool_call_id(_call_id.get()):
                return await self.saga_run.call(self.name, **kwargs)
        except ToolException as exc:
            if self.unwind_on_tool_error:
                raise ToolErrorUnwind.of(self.name, exc) from exc
            raise

    def _run(self, **_kwargs: Any) -> Any:
        raise ConfigurationError(
            f"tool {self.name!r} runs inside an async saga run: call the graph or tool with "
            "ainvoke/astream, not invoke"
        )
