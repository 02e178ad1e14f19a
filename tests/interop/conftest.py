"""The Node.js example agent's npm packages, installed once per session.

``npm ci`` runs in examples/node_agent when its node_modules is missing or
older than package-lock.json (``--prefer-offline``: a warm npm cache needs no
network). Node and npm missing is a failure naming the fix, never a skip.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

AGENT_DIR = Path(__file__).resolve().parents[2] / "examples" / "node_agent"


def _installed(folder: Path) -> bool:
    marker = folder / "node_modules" / ".package-lock.json"  # npm writes it on every install
    lock = folder / "package-lock.json"
    return marker.exists() and marker.stat().st_mtime >= lock.stat().st_mtime


@pytest.fixture(scope="session")
def node_agent() -> Path:
    """The path of examples/node_agent/agent.mjs, its packages installed."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail(
            "the Node.js interop tests need node and npm on PATH: run scripts/debian-deps "
            "(or apt-get install nodejs npm)",
            pytrace=False,
        )
    if not _installed(AGENT_DIR):
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--prefer-offline", "--ignore-scripts"],
            cwd=AGENT_DIR,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(
                f"npm ci in {AGENT_DIR} failed ({done.returncode}): {done.stderr.strip()[-2000:]}",
                pytrace=False,
            )
    return AGENT_DIR / "agent.mjs"
