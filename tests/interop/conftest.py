"""The Node.js example agent's npm packages, installed once per session.

``npm ci`` runs in examples/node_agent when its node_modules is missing or
older than package-lock.json (``--prefer-offline``: a warm npm cache needs no
network). Node and npm missing is a failure naming the fix, never a skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import install_node_agent


@pytest.fixture(scope="session")
def node_agent() -> Path:
    """The path of examples/node_agent/agent.mjs, its packages installed."""
    try:
        return install_node_agent()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
