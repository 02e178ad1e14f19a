"""An agent that installs the library alone gets none of the sidecar's server stack.

One slow test (a real ``pip install`` of this repository into a fresh virtualenv,
no extras): the installed distributions hold no aiohttp, grpcio, click, rich or jinja2,
and none of the frameworks the adapters wrap (mcp, pydantic-ai, langchain, openai-agents);
``examples/refund_agent.py`` runs there, from a folder that holds only the
examples, so ``saga_otel`` comes from the install; the same install exports a
run to a real sidecar (started from the dev environment); and the ``saga-sidecar``
command it ships says in one line which extra to install.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import SidecarProcess, wait_until

ROOT = Path(__file__).resolve().parent.parent
# The sidecar's server stack, as distribution names (PEP 503 normalized).
SERVER_STACK = {
    "aiohttp",
    "grpcio",
    "click",
    "rich",
    "jinja2",
    "opentelemetry-exporter-otlp-proto-grpc",
    "psycopg",  # --db postgresql://
    "psycopg-binary",
    "psycopg-pool",
    "rbloom",  # the SQLite store's filter of runs put away
    "httpx",  # the sidecar CLI's API client (recover() has its own loopback client)
}
# The framework adapters' distributions: each is an extra (saga-otel[mcp], ...), never pulled alone.
FRAMEWORKS = {
    "mcp",
    "mcp-types",
    "pydantic-ai-slim",
    "pydantic-ai",
    "pydantic",
    "langchain-core",
    "langgraph",
    "langsmith",
    "openai-agents",
    "openai",
}

LIST_DISTRIBUTIONS = """
import importlib.metadata, json
print(json.dumps(sorted({d.metadata["Name"] for d in importlib.metadata.distributions()})))
"""

EXPORTING_AGENT = """
import asyncio
from examples.refund_agent import run_refund
from examples.refund_tools import refund_tools
from examples.world import World
from saga_otel import Saga, configure

export = configure()  # SAGA_OTEL_SIDECAR_ENDPOINT
report = asyncio.run(run_refund(Saga("refund", tools=refund_tools(World(mail_down=True)))))
export.shutdown()
print(report.run_id, report.status.value)
"""


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> Any:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_library_only_install_has_no_server_stack_and_runs_an_agent(
    tmp_path: Path, sidecar_process: Any
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    install = subprocess.run(
        [py, "-m", "pip", "install", "-q", str(ROOT)],
        capture_output=True, text=True, timeout=800,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr

    # A folder with the examples and nothing else: saga_otel must come from the venv.
    agent_dir = tmp_path / "agent"
    shutil.copytree(
        ROOT / "examples", agent_dir / "examples", ignore=shutil.ignore_patterns("node_modules")
    )
    env = {"PATH": "/usr/bin:/bin", "SAGA_OTEL_LOG_LEVEL": "ERROR"}

    listed = _run([py, "-c", LIST_DISTRIBUTIONS], agent_dir, env)
    assert listed.returncode == 0, listed.stderr
    installed = {_normalize(n) for n in json.loads(listed.stdout)}
    assert "saga-otel" in installed and "opentelemetry-sdk" in installed, installed
    assert not installed & SERVER_STACK, f"the library pulled {sorted(installed & SERVER_STACK)}"
    assert not installed & FRAMEWORKS, f"the library pulled {sorted(installed & FRAMEWORKS)}"

    where = _run([py, "-c", "import saga_otel; print(saga_otel.__file__)"], agent_dir, env)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    # The wheel carries the sidecar's page templates (package data, not modules).
    templates = Path(where.stdout.strip()).parent.parent / "sidecar" / "templates"
    assert {p.name for p in templates.glob("*.html")} >= {"base.html", "run.html", "review.html"}

    # The example as its docstring runs it.
    out = _run([py, "-m", "examples.refund_agent", "--mail-down"], agent_dir, env)
    assert out.returncode == 0, out.stderr
    assert ": compensated" in out.stdout and "'amount': -2500" in out.stdout, out.stdout

    # The same install exports a run to a sidecar running elsewhere.
    sc: SidecarProcess = sidecar_process()
    sent = _run(
        [py, "-c", EXPORTING_AGENT], agent_dir, {**env, "SAGA_OTEL_SIDECAR_ENDPOINT": sc.otlp}
    )
    assert sent.returncode == 0, sent.stderr
    run_id, status = sent.stdout.split()
    assert status == "compensated"

    def sidecar_status() -> object:
        resp = httpx.get(f"{sc.api}/runs/{run_id}", timeout=5)
        return resp.status_code == 200 and resp.json().get("status") == "compensated"

    wait_until(sidecar_status, what=f"run {run_id} compensated at the sidecar")

    # The sidecar's command is installed too; without its stack it says what to install.
    served = _run([str(venv / "bin" / "saga-sidecar"), "serve"], agent_dir, env)
    assert served.returncode == 1
    assert "Traceback" not in served.stderr
    (line,) = served.stderr.splitlines()
    assert "pip install 'saga-otel[sidecar]'" in line and "aiohttp" in line, line

    # An adapter without its extra says in one line which extra to install.
    for module, extra in (
        ("saga_otel.adapters.mcp", "mcp"),
        ("saga_otel.adapters.pydantic_ai", "pydantic-ai"),
        ("saga_otel.adapters.langchain", "langchain"),
        ("saga_otel.adapters.openai_agents", "openai-agents"),
    ):
        imported = _run([py, "-c", f"import {module}"], agent_dir, env)
        assert imported.returncode == 1
        assert f"pip install 'saga-otel[{extra}]'" in imported.stderr.splitlines()[-1]
    # Declarations need no framework: Declare comes from the adapters package itself.
    declared = _run(
        [py, "-c", "from saga_otel.adapters import Declare; Declare(undo='u')"], agent_dir, env
    )
    assert declared.returncode == 0, declared.stderr
    review = _run([str(venv / "bin" / "saga-otel"), "mcp-tools", "server"], agent_dir, env)
    assert review.returncode == 2 and "Traceback" not in review.stderr
    (line,) = review.stderr.splitlines()
    assert "pip install 'saga-otel[mcp]'" in line, line

    # The library's own command needs none of it.
    version = _run([str(venv / "bin" / "saga-otel"), "--version"], agent_dir, env)
    assert version.returncode == 0 and version.stdout.startswith("saga-otel "), version.stderr
