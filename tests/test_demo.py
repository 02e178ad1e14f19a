"""`make demo` as a newcomer runs it: the same module, end to end, real processes."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_tells_the_whole_story() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "examples.demo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        # Piped, with no COLUMNS: the case where ids used to be cut.
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    # Act 1: a completed run, drawn.
    assert "Act 1" in out and "status COMPLETED" in out
    # Act 2: unwound, with the alert as the webhook received it, then resolved.
    assert "SagaCompensationStarted (warning) at the webhook" in out
    assert "resolved when the run ended compensated" in out
    assert "status COMPENSATED" in out
    # Each act prints only its own ledger entries.
    assert out.count("ledger, Act") == 3
    assert "ledger, Act 2 only (2 entries)" in out and "net +0 for order 4921 in Act 2" in out
    # Act 3: killed, orphan alert with the stack, recovered from another process.
    assert "SagaRunOrphaned (critical) at the webhook" in out
    assert "rebuilt the stack from the spans (1 undo, top first)" in out
    assert re.search(r'1\. reverse_credit\(credit_id="cr_\d+_4921"\)  undoes #1 issue_credit', out)
    assert "SagaRunOrphaned resolved at the webhook" in out
    assert "status RECOVERED" in out
    assert "net +0 for order 4921 in Act 3" in out and "ticket T-9104 is open" in out
    assert "done in" in out
    # No Python repr anywhere, and every run id is printed whole.
    assert "[('" not in out and "{'" not in out
    run_ids = re.findall(r"\brun ([0-9a-f]{32})\b", out)
    assert len(set(run_ids)) == 3
    # The printed recover command is complete: world, tools, sidecar and OTLP addresses.
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("$ SAGA_DEMO_WORLD="))
    argv = shlex.split(line.strip()[2:])
    assert argv[0].startswith("SAGA_DEMO_WORLD=http://127.0.0.1:")
    assert (ROOT / argv[1]).exists() and argv[2:4] == ["recover", run_ids[-1]]
    assert {"--tools", "--sidecar", "--otlp"} <= set(argv)
