"""A run view drawn for a person: forward steps beside the compensation stack, then the unwind."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from saga_otel import semconv as sc

_STATUS_STYLE = {
    sc.STATUS_COMPLETED: "green",
    sc.STATUS_COMPENSATED: "green",
    sc.STATE_RECOVERED: "green",
    sc.STATE_RUNNING: "cyan",
    sc.STATE_UNWINDING: "yellow",
    sc.STATUS_REJECTED: "yellow",
    sc.STATUS_COMPENSATION_FAILED: "bold red",
    sc.STATUS_STUCK: "bold red",
    sc.STATE_ORPHANED: "bold red",
}


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _call(item: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={json.dumps(v)}" for k, v in (item.get("args") or {}).items())
    return f"{item.get('tool')}({args})"


def _mark(ok: bool) -> Text:
    return Text("✓", style="green") if ok else Text("✗", style="bold red")


def render_run(view: dict[str, Any]) -> RenderableType:
    """The diagram for one run view (the JSON of GET /runs/{id})."""
    status = str(view.get("status"))
    head = Text.assemble(
        ("saga ", "dim"),
        (str(view.get("saga")), "bold"),
        ("  run ", "dim"),
        str(view.get("run_id")),
        ("  status ", "dim"),
        (status.upper(), _STATUS_STYLE.get(status, "")),
    )
    facts = Text(
        f"service {view.get('service') or '-'}  instance {view.get('instance') or '-'}  "
        f"started {_when(view.get('started_at'))}  ended {_when(view.get('ended_at'))}",
        style="dim",
    )
    parts: list[RenderableType] = [head, facts]
    if view.get("failed_step"):
        parts.append(Text(f"failed step: {view['failed_step']}", style="red"))
    if view.get("unwind_reason"):
        parts.append(Text(f"unwind reason: {view['unwind_reason']}"))

    steps = list(view.get("steps") or [])
    pivot = view.get("pivot")
    table = Table(show_edge=True, expand=False, pad_edge=True)
    table.add_column("FORWARD", no_wrap=False)
    table.add_column("COMPENSATION STACK", no_wrap=False)
    for step in steps:
        attempts = step.get("attempts") or []
        tries = f" x{len(attempts)}" if len(attempts) > 1 else ""
        left = Text.assemble(
            _mark(bool(step.get("ok"))),
            f" #{step['index']} {step.get('name')} ",
            (f"({step.get('class') or '?'}){tries}", "dim"),
        )
        if not step.get("ok") and attempts:
            left.append(f"\n   {attempts[-1].get('error')}", style="red")
        comp = step.get("compensation")
        if comp:
            if step.get("compensated"):
                right = Text(f"{_call(comp)}  undone", style="dim strike")
            elif step.get("compensation_failed"):
                right = Text(f"{_call(comp)}  FAILED", style="bold red")
            else:
                right = Text(f"{_call(comp)}  pending")
        elif step.get("class") == "read":
            right = Text("(nothing to undo)", style="dim")
        elif step.get("class") == "irreversible" or step.get("pivot"):
            right = Text("(cannot be undone)", style="yellow")
        else:
            right = Text("-", style="dim")
        table.add_row(left, right)
        if pivot and step["index"] == pivot.get("index"):
            table.add_row(
                Text(f"━━ PIVOT: {pivot.get('step')} (#{pivot.get('index')}) ━━", style="yellow"),
                Text("━━ no undo past this line ━━", style="yellow"),
            )
    parts.append(table)

    unwound = sorted(
        (s for s in steps if s.get("compensations")), key=lambda s: s["index"], reverse=True
    )
    if unwound or view.get("unwind_started_at") is not None:
        parts.append(Rule("UNWIND (reverse order)", align="left"))
        started = view.get("unwind_started_at")
        parts.append(Text(f"started {_when(started)}", style="dim"))
        for step in unwound:
            comps = step["compensations"]
            ok = bool(step.get("compensated"))
            comp = step.get("compensation") or {"tool": "?", "args": {}}
            line = Text.assemble(
                _mark(ok),
                f" #{step['index']} {step.get('name')}: {_call(comp)}",
                (f"  {len(comps)} attempt(s)", "dim"),
            )
            if not ok:
                line.append(f"\n   last error: {comps[-1].get('error')}", style="red")
            parts.append(line)
        if not unwound:
            parts.append(Text("(no compensation has run yet)", style="dim"))

    stack = view.get("stack") or []
    parts.append(Rule("LEFT ON THE STACK (top first)", align="left"))
    if stack and view.get("status") == "completed":
        # A completed run keeps its undo records for the record, not to run them.
        parts.append(Text(f"  {len(stack)} undo record(s) kept; the run completed, none will run"))
    elif stack:
        if view.get("status") == "stuck":
            parts.append(Text("  past the pivot: a person decides about these", style="red"))
        for item in stack:
            parts.append(
                Text(f"  #{item['index']} {item.get('step')}: {_call(item)}  {item['description']}")
            )
    else:
        parts.append(Text("  (empty: nothing left to undo)", style="dim"))

    escalation = view.get("escalation")
    if escalation:
        parts.append(Rule(f"ESCALATED: {escalation.get('reason')}", align="left", style="red"))
        parts.append(Text(json.dumps(escalation.get("card"), indent=2, sort_keys=True)))
    resolution = view.get("resolution")
    if resolution:
        parts.append(
            Text(f"resolved {_when(resolution.get('at'))}: {resolution.get('note')}", "green")
        )
    return Group(*parts)
