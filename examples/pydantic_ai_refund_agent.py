"""The refund agent on pydantic-ai: the agent's own tools, declared once, run as saga steps.

Run it: ``python -m examples.pydantic_ai_refund_agent [--mail-down]``. A scripted
model (pydantic-ai's FunctionModel: offline, no key) calls the tools as a real
one would. With the mail down the reply raises, the error escapes ``agent.run``
and the saga unwinds through the same tools: ticket reopened, credit reversed.
"""

from __future__ import annotations

from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

from examples import framework_refund
from examples.framework_refund import DECLARE, PROMPT, SCRIPT, refund_functions
from examples.world import World
from saga_otel import Run
from saga_otel.adapters.pydantic_ai import SagaTools

__all__ = ["DECLARE", "SCRIPT", "refund_toolset", "scripted_model"]


def refund_toolset(world: World) -> FunctionToolset[None]:
    """The agent's tools, as any pydantic-ai agent would have them."""
    return FunctionToolset(refund_functions(world))


def scripted_model(script: list[tuple[str, str, dict[str, Any]]]) -> FunctionModel:
    """A model that makes the scripted calls one per turn, then answers."""
    turns = iter(script)

    def respond(_messages: list[ModelMessage], _info: AgentInfo) -> ModelResponse:
        step = next(turns, None)
        if step is None:
            return ModelResponse(parts=[TextPart("Refund done.")])
        call_id, name, args = step
        return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=call_id)])

    return FunctionModel(respond)


async def agent(tools: SagaTools, run: Run) -> str:
    result = await Agent(scripted_model(SCRIPT)).run(PROMPT, toolsets=[tools.toolset(run)])
    return result.output


if __name__ == "__main__":
    framework_refund.main(__doc__, lambda world: SagaTools(refund_toolset(world), DECLARE), agent)
