"""Helpers shared by the test folders: real sidecar processes, bounded waits."""

from __future__ import annotations

import random
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from saga_otel.testing import AlertReceiver, SidecarProcess, start_sidecar

__all__ = [
    "AlertReceiver",
    "SidecarProcess",
    "install_node_agent",
    "resent_cut_by_the_kill",
    "sql_on",
    "start_sidecar",
    "wait_until",
]

NODE_AGENT_DIR = Path(__file__).resolve().parents[1] / "examples" / "node_agent"


def _node_installed(folder: Path) -> bool:
    marker = folder / "node_modules" / ".package-lock.json"  # npm writes it on every install
    lock = folder / "package-lock.json"
    return marker.exists() and marker.stat().st_mtime >= lock.stat().st_mtime


def install_node_agent() -> Path:
    """examples/node_agent/agent.mjs with its npm packages installed (``npm ci`` when
    node_modules is missing or older than package-lock.json; ``--prefer-offline``).

    Raises RuntimeError naming the fix when node/npm are missing or npm ci fails.
    """
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        raise RuntimeError(
            "the Node.js agent needs node and npm on PATH: run scripts/debian-deps "
            "(or apt-get install nodejs npm)"
        )
    if not _node_installed(NODE_AGENT_DIR):
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--prefer-offline", "--ignore-scripts"],
            cwd=NODE_AGENT_DIR,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"npm ci in {NODE_AGENT_DIR} failed ({done.returncode}): "
                f"{done.stderr.strip()[-2000:]}"
            )
    return NODE_AGENT_DIR / "agent.mjs"


def restart_port() -> int:
    """A free loopback port for a server a test kills and restarts on the same port.

    Outside the kernel's ephemeral range: a port bound with 0 comes from that range, and
    between the kill and the restart any outgoing connection on the machine (an agent
    retrying, a load generator) may take it as its source port, so the restart fails
    "address in use" (seen once in a full run).
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in 10000..{low - 1}")


def wait_until(probe: Callable[[], object], timeout: float = 30.0, what: str = "") -> object:
    """Poll until ``probe()`` is truthy; a bounded wait, never a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting{' for ' + what if what else ''}")
        time.sleep(0.02)


def resent_cut_by_the_kill(pager: AlertReceiver, killed_by: float) -> dict[tuple[str, str], int]:
    """The alerts delivered twice, checked to be at most the one send a SIGKILL can cut.

    Delivery is at least once: a sink worker killed between the receiver's accept and
    the row's mark leaves that row to be sent again by whoever delivers next. So at
    most one (dedup key, status) may come exactly twice, first received no later than
    ``killed_by`` (epoch seconds: the killed process gone, before any other could send
    that row; not the moment of ``kill()``, as the receiver stamps a request when its
    thread reads it, which may be after its sender died); any other repeat is a fault
    and fails here.
    """
    twice = {k: n for k, n in pager.keys().items() if n > 1}
    assert len(twice) <= 1 and set(twice.values()) <= {2}, twice
    for dedup_key, status in twice:
        first = min(
            a["_received"]
            for a in pager.alerts
            if (a["dedup_key"], a["status"]) == (dedup_key, status)
        )
        assert first <= killed_by, (dedup_key, status, first, killed_by)
    return twice


Sql = Callable[..., list[tuple[Any, ...]]]


@contextmanager
def sql_on(db: str) -> Iterator[Sql]:
    """``run(text, rows=None)`` on the sidecar database ``db`` (a SQLite file or a
    ``postgresql://`` URL) in autocommit, with ``?`` placeholders on both backends: the
    rows a query returns, or an executemany of ``rows``."""
    if "://" in db:
        import psycopg

        conn: Any = psycopg.connect(db, autocommit=True)
        mark = "%s"
    else:
        conn = sqlite3.connect(db, isolation_level=None)
        mark = "?"

    def run(text: str, rows: list[tuple[Any, ...]] | None = None) -> list[tuple[Any, ...]]:
        text = text.replace("?", mark)
        if rows is not None:
            conn.cursor().executemany(text, rows)
            return []
        cur = conn.execute(text)
        return list(cur.fetchall()) if cur.description else []

    try:
        yield run
    finally:
        conn.close()


def run_child(script: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``script`` run by this Python in a child process from the project's root (fork and
    signal tests: what they break stays in the child), its output captured, bounded."""
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=str(Path(__file__).resolve().parents[1]),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
