"""Framework adapters, one optional module (and pip extra) each.

This package imports no framework: ``saga_otel.adapters.mcp`` needs
``saga-otel[mcp]``, ``saga_otel.adapters.pydantic_ai`` needs
``saga-otel[pydantic-ai]``, and so on (see docs/frameworks.md). :class:`Declare`,
the per-tool declaration every adapter takes, is here too, so declarations can
be written once without importing a framework.
"""

from saga_otel.adapters._declare import Declare

__all__ = ["Declare"]
