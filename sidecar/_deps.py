"""The sidecar's own dependencies, checked before anything imports them.

The ``saga-otel`` wheel carries this package, but an agent that installs the
library alone gets none of the server stack; the ``saga-otel[sidecar]`` extra
brings it. This module imports nothing from that stack, so the check can run
(and fail with one clear line) where the stack is missing.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Final

from ._errors import SidecarError

# Import name -> distribution name, for the modules the sidecar imports at load time.
SERVER_STACK: Final = {
    "aiohttp": "aiohttp",
    "grpc": "grpcio",
    "click": "click",
    "rich": "rich",
    "jinja2": "jinja2",  # the run page and review queue (sidecar/templates)
    "httpx": "httpx",  # `saga-sidecar runs ...`: the running sidecar's API
    "rbloom": "rbloom",  # the SQLite store's filter of runs put away
}
INSTALL_HINT: Final = "pip install 'saga-otel[sidecar]'"


class MissingServerStackError(SidecarError, ImportError):
    """The sidecar's dependencies are not installed: the message names them and the fix."""


def missing() -> list[str]:
    """Distribution names of the server stack that cannot be imported here."""
    return [dist for mod, dist in SERVER_STACK.items() if importlib.util.find_spec(mod) is None]


def require_server_stack() -> None:
    """Raise MissingServerStackError naming what is missing and the install line."""
    absent = missing()
    if absent:
        raise MissingServerStackError(
            f"the sidecar needs {', '.join(absent)}, which are not installed: {INSTALL_HINT}"
        )


def main() -> None:
    """The ``saga-sidecar`` console script: one line and exit 1 when the stack is missing."""
    try:
        require_server_stack()
    except MissingServerStackError as exc:
        sys.exit(f"saga-sidecar: {exc}")
    from ._cli import main as cli_main

    cli_main()
