"""`make demo` as a newcomer runs it: the same module, end to end, real processes."""

from __future__ import annotations

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
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "COLUMNS": "120"},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    # Act 1: a completed run, drawn.
    assert "Act 1" in out and "status COMPLETED" in out
    # Act 2: unwound, with the alert as the webhook received it, then resolved.
    assert "SagaCompensationStarted (warning) at the webhook" in out
    assert "resolved when the run ended compensated" in out
    assert "status COMPENSATED" in out and "ledger for order 4921: [2500, 2500, -2500]" in out
    # Act 3: killed, orphan alert with the stack, recovered from another process.
    assert "SagaRunOrphaned (critical) at the webhook" in out
    assert "the sidecar's stack: [('reverse_credit'" in out
    assert "status RECOVERED" in out
    assert "(balance 2500), ticket open" in out
    assert "done in" in out
