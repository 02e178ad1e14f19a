"""Framework adapters, one optional module (and pip extra) each.

This package imports nothing: ``saga_otel.adapters.mcp`` needs
``saga-otel[mcp]``, ``saga_otel.adapters.pydantic_ai`` needs
``saga-otel[pydantic-ai]``, and so on (see docs/frameworks.md).
"""
