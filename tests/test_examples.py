"""Every example runs, as a user would run it, and does what its docstring says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "SAGA_OTEL_LOG_LEVEL": "ERROR"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_refund_agent_example_unwinds_when_mail_is_down() -> None:
    out = run("examples.refund_agent", "--mail-down")
    assert ": compensated" in out
    assert "'amount': -2500" in out and "'reverses'" in out
    assert "'T-9104': 'open'" in out


def test_refund_agent_example_escalates_a_stuck_run() -> None:
    out = run("examples.refund_agent", "--close-fails")
    assert ": stuck" in out
    assert "You must decide" in out


def test_release_saga_example_validates_up_front() -> None:
    assert ": rejected" in run("examples.release_saga", "--bad-metadata")
    out = run("examples.release_saga", "--flag-down")
    assert ": compensated" in out and "'title': 'Old title'" in out
    assert ": completed" in run("examples.release_saga")


def test_own_runner_example_is_instrumented_in_under_ten_lines() -> None:
    out = run("examples.own_runner")
    assert out.startswith("compensated")
    source = (ROOT / "examples" / "own_runner.py").read_text()
    body = source.split("# --- the instrumentation: under ten lines", 1)[1]
    body = body.split('\n\nif __name__ == "__main__":', 1)[0]
    code = [line for line in body.splitlines()[1:] if line.strip()]
    assert len(code) < 10 + 1, code  # the def line plus under ten lines of body
