"""The refund registry for a process that joins the demo's world by URL.

``saga-otel recover RUN --tools examples.demo_tools:registry`` imports this,
with ``SAGA_DEMO_WORLD`` naming the world server.
"""

from __future__ import annotations

import os

from examples.refund_tools import refund_tools
from examples.world_server import RemoteWorld
from saga_otel import ToolRegistry


def registry() -> ToolRegistry:
    url = os.environ.get("SAGA_DEMO_WORLD")
    if not url:
        raise RuntimeError("set SAGA_DEMO_WORLD to the world server's URL (the demo prints it)")
    return refund_tools(RemoteWorld(url))
