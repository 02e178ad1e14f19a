"""The README's run drawing is the renderer's real output, not a hand-drawn picture.

The drawing is regenerated from the README's own refund story (get_order, a credit, a
ticket update, the reply failing) folded by the real run state and drawn by
`render_run` at 80 columns. Set SAGA_WRITE_README=1 to rewrite the README block after
changing the renderer on purpose.
"""

from __future__ import annotations

import os
from datetime import UTC
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from rich.console import Console
from sidecar_testkit import RunScript

from saga_otel import semconv as sc
from sidecar import RunState, render_run
from sidecar._otlp import extract

README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- run-drawing:start -->\n```\n", "```\n<!-- run-drawing:end -->"
CREDIT = ("reverse_credit", {"credit_id": "cr_9104_4921"}, "reverse credit cr_9104_4921")
TICKET = (
    "set_ticket_status",
    {"ticket_id": "T-9104", "status": "open"},
    "put ticket T-9104 back to open",
)


def drawing() -> str:
    r = RunScript(
        "refund",
        run_id="3f9c2a7e5b1d4c8e9a6f0b2d7c4e1a95",
        instance="refund-agent-7f3c",
        t0=1_767_261_600.0,  # 2026-01-01 10:00 UTC: fixed, so the drawing is stable
    )
    r.do(0, "get_order", "read")
    r.do(1, "issue_credit", "compensable", comp=CREDIT)
    r.do(2, "set_ticket_status", "reversible", comp=TICKET)
    error = "ServiceDown: mail service unavailable (503)"
    r.do(3, "send_reply", "irreversible", ok=False, error=error)
    stack = [
        {"step": s, "index": i, "tool": c[0], "args": c[1], "description": c[2]}
        for s, i, c in (("set_ticket_status", 2, TICKET), ("issue_credit", 1, CREDIT))
    ]
    r.unwind(error, "send_reply", stack)
    r.compensate(2, "set_ticket_status", TICKET[0], TICKET[1])
    r.compensate(1, "issue_credit", CREDIT[0], CREDIT[1])
    r.end(sc.STATUS_COMPENSATED, "send_reply")
    state = RunState()
    state.apply(extract(encode_spans(r.spans())).spans, r.t + 1)
    view = state.view(r.run_id)
    assert view is not None
    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=80, color_system=None, file=sink)
        # A fixed clock and zone: the drawing must not change with the machine or the hour.
        console.print(render_run(view, now=r.t + 90, tz=UTC))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def test_readme_drawing_is_the_renderers_output() -> None:
    text = README.read_text(encoding="utf-8")
    assert START in text and END in text, f"README.md lost its {START.strip()} markers"
    head, rest = text.split(START, 1)
    current, tail = rest.split(END, 1)
    fresh = drawing()
    if os.environ.get("SAGA_WRITE_README") == "1":
        README.write_text(head + START + fresh + END + tail, encoding="utf-8")
        current = fresh
    assert current == fresh, (
        "README.md's run drawing differs from render_run's output; if the renderer "
        "changed on purpose, run: SAGA_WRITE_README=1 make test PYTEST_ARGS="
        "tests/sidecar/test_readme_drawing.py"
    )
