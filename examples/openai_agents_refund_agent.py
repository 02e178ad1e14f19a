"""The refund agent on the OpenAI Agents SDK: its function tools run as saga steps.

Run it: ``python -m examples.openai_agents_refund_agent [--mail-down]``. A scripted
``Model`` (offline, no key; the SDK's tracing export is off) asks for the calls a
real model would. The SDK hands a tool's exception to the model by default; this
agent asks for ``unwind_on_tool_error``, so with the mail down the failed reply
unwinds the saga through the same tools: ticket reopened, credit reversed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from agents import (
    Agent,
    FunctionTool,
    Model,
    ModelResponse,
    Runner,
    Usage,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from examples import framework_refund
from examples.framework_refund import DECLARE, PROMPT, SCRIPT, refund_functions
from examples.world import World
from saga_otel import Run
from saga_otel.adapters.openai_agents import SagaTools

__all__ = ["DECLARE", "SCRIPT", "ScriptedModel", "refund_tools"]


def refund_tools(world: World) -> list[FunctionTool]:
    """The agent's function tools, as any Agents SDK agent would have them."""
    return [function_tool(fn) for fn in refund_functions(world)]


class ScriptedModel(Model):
    """A Model that asks for the scripted calls one per turn, then answers."""

    def __init__(self, script: list[tuple[str, str, dict[str, Any]]]) -> None:
        self.turns = iter(script)
        self.inputs: list[Any] = []  # what the model was shown each turn

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        self.inputs.append(kwargs.get("input", args[1] if len(args) > 1 else None))
        step = next(self.turns, None)
        if step is None:
            text = ResponseOutputText(type="output_text", text="Refund done.", annotations=[])
            item: Any = ResponseOutputMessage(
                id="msg", type="message", role="assistant", status="completed", content=[text]
            )
        else:
            call_id, name, args_ = step
            item = ResponseFunctionToolCall(
                type="function_call", call_id=call_id, name=name, arguments=json.dumps(args_)
            )
        return ModelResponse(output=[item], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the scripted model does not stream")


def saga_tools(world: World) -> SagaTools:
    set_tracing_disabled(True)  # no export to OpenAI: the saga's spans go to the sidecar
    return SagaTools(refund_tools(world), DECLARE, unwind_on_tool_error=True)


async def agent(tools: SagaTools, run: Run) -> str:
    model = ScriptedModel(SCRIPT)
    result = await Runner.run(Agent(name="refunds", model=model, tools=tools.bind(run)), PROMPT)
    return str(result.final_output)


if __name__ == "__main__":
    framework_refund.main(__doc__, saga_tools, agent)
