"""A run view drawn for a person: forward steps beside the compensation stack, then the unwind."""

from __future__ import annotations

import json
import time
from datetime import datetime, tzinfo
from typing import Any, Final, TypeVar, cast

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.constrain import Constrain
from rich.measure import Measurement
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from saga_otel import semconv as sc
from saga_otel.records import EscalationCard, is_pivot

from ._alerting import counted
from ._views import CompensationView, RunView

_T = TypeVar("_T")

# What an agent sends is shown, never obeyed: characters that steer a terminal (C0
# but tab and newline, DEL, C1: escape sequences, carriage returns) or reorder what
# a person reads (bidi embeddings, overrides, isolates) become visible escapes.
_ESCAPES: Final[dict[int, str]] = {
    **{c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (0x09, 0x0A)},
    **{c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))},
}


def printable(text: str) -> str:
    """``text`` safe to print or draw: ``\\x1b`` for ESC, ``\\u202e`` for a bidi override."""
    return text.translate(_ESCAPES)


# In a table, a list or a stack a newline the agent sent would draw a line of its own
# that reads as the sidecar's (a fake "completed", a fake stack header): shown as \n.
_ONE_LINE: Final[dict[int, str]] = {**_ESCAPES, 0x0A: "\\n"}


def printable_doc(doc: _T) -> _T:
    """``doc`` (JSON: a run view, a summary, a stack) with every string, key or value,
    made :func:`printable` and kept on one line (a newline shown as ``\\n``). Run ids
    are printable by the contract: they stay as sent."""
    value: Any = doc
    if isinstance(value, str):
        value = value.translate(_ONE_LINE)
    elif isinstance(value, dict):
        value = {printable_doc(k): printable_doc(v) for k, v in value.items()}
    elif isinstance(value, list):
        value = [printable_doc(v) for v in value]
    return cast(_T, value)


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


def when(epoch: float | None, now: float | None = None, tz: tzinfo | None = None) -> str:
    """Local ISO-8601 time (``tz`` for tests), and its age when ``now`` is given."""
    if epoch is None:
        return "-"
    text = (
        datetime.fromtimestamp(epoch, tz).isoformat(timespec="seconds") if tz else local_time(epoch)
    )
    return text if now is None else f"{text} ({age(now - epoch)} ago)"


def _cell_call(item: CompensationView) -> str:
    """An undo call for a table cell: one argument per line once it is long, so the
    references a person copies (credit ids, ticket ids) are not split mid-value."""
    one_line = _call(item)
    if len(one_line) <= 32 or not item["args"]:
        return one_line
    args = ",\n".join(f"  {k}={json.dumps(v)}" for k, v in item["args"].items())
    return f"{item['tool']}(\n{args})"


def local_time(epoch: float) -> str:
    """Local ISO-8601 with the offset, to the second: ``2026-03-01T14:02:09+01:00``."""
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def age(seconds: float) -> str:
    """``2d 3h``, ``3h 12m``, ``12m 5s``, ``40s``: two units are enough to sort by eye."""
    s = max(int(seconds), 0)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {s}s"
    return f"{s}s"


def _call(item: CompensationView) -> str:
    args = ", ".join(f"{k}={json.dumps(v)}" for k, v in item["args"].items())
    return f"{item['tool']}({args})"


def _mark(ok: bool) -> Text:
    return Text("✓", style="green") if ok else Text("✗", style="bold red")


def render_run(
    view: RunView, *, now: float | None = None, tz: tzinfo | None = None
) -> RenderableType:
    """The diagram for one run view (the JSON of GET /runs/{id}).

    Times are local ISO-8601 with their age against ``now`` (default: the clock);
    ``tz`` fixes the zone (tests, the README drawing). Every text the agent sent is
    drawn :func:`printable`.
    """
    now = time.time() if now is None else now
    view = printable_doc(view)

    def _when(epoch: float | None) -> str:
        return when(epoch, now, tz)

    status = view["status"]
    head = Text.assemble(
        ("saga ", "dim"),
        (view["saga"], "bold"),
        ("  run ", "dim"),
        view["run_id"],
        ("  status ", "dim"),
        (status.upper(), _STATUS_STYLE.get(status, "")),
    )
    facts = Text(
        f"service {view['service'] or '-'}  instance {view['instance'] or '-'}\n"
        f"started {_when(view['started_at'])}\n"
        f"ended   {_when(view['ended_at'])}",
        style="dim",
    )
    parts: list[RenderableType] = [head, facts]
    if view["failed_step"]:
        parts.append(Text(f"failed step: {view['failed_step']}", style="red"))
    if view["unwind_reason"]:
        parts.append(Text(f"unwind reason: {view['unwind_reason']}"))

    steps = view["steps"]
    pivot = view["pivot"]
    table = Table(show_edge=True, expand=False, pad_edge=True)
    table.add_column("FORWARD", no_wrap=False, overflow="fold")
    table.add_column("COMPENSATION STACK", no_wrap=False, overflow="fold")
    for step in steps:
        attempts = step["attempts"]
        tries = f" x{len(attempts)}" if len(attempts) > 1 else ""
        left = Text.assemble(
            _mark(step["ok"]),
            f" #{step['index']} {step['name']} ",
            (f"({step['class'] or '?'}){tries}", "dim"),
        )
        if not step["ok"] and attempts:
            left.append(f"\n   {attempts[-1]['error']}", style="red")
        comp = step["compensation"]
        if comp:
            if step["compensated"]:
                right = Text(f"{_cell_call(comp)}\n  undone", style="dim strike")
            elif step["compensation_failed"]:
                right = Text(f"{_cell_call(comp)}\n  FAILED", style="bold red")
            else:
                right = Text(f"{_cell_call(comp)}\n  pending")
        elif step["class"] == "read":
            right = Text("(nothing to undo)", style="dim")
        elif is_pivot(step["class"], step["pivot"]):
            right = Text("(cannot be undone)", style="yellow")
        else:
            right = Text("-", style="dim")
        if step["compensation_unstorable"]:
            right = Text(f"NO UNDO STORED: {step['compensation_unstorable']}", style="bold red")
        table.add_row(left, right)
        if pivot and step["index"] == pivot["index"]:
            table.add_row(
                Text(f"━━ PIVOT: {pivot['step']} (#{pivot['index']}) ━━", style="yellow"),
                Text("━━ no undo past this line ━━", style="yellow"),
            )
    parts.append(table)

    unwound = sorted(
        (s for s in steps if s["compensations"]), key=lambda s: s["index"], reverse=True
    )
    if unwound or view["unwind_started_at"] is not None:
        parts.append(Rule("UNWIND (reverse order)", align="left"))
        started = view["unwind_started_at"]
        parts.append(Text(f"started {_when(started)}", style="dim"))
        for step in unwound:
            comps = step["compensations"]
            ok = step["compensated"]
            comp_text = _call(step["compensation"]) if step["compensation"] else "?()"
            # The call on a line of its own: at 80 columns a long one wrapped mid-count.
            line = Text.assemble(
                _mark(ok),
                f" #{step['index']} {step['name']}",
                (f"  {counted(len(comps), 'attempt')}", "dim"),
                f"\n    {comp_text}",
            )
            if not ok:
                line.append(f"\n    last error: {comps[-1]['error']}", style="red")
            parts.append(line)
        if not unwound:
            parts.append(Text("(no compensation has run yet)", style="dim"))

    stack = view["stack"]
    parts.append(Rule("LEFT ON THE STACK (top first)", align="left"))
    if stack and status == "completed":
        # A completed run keeps its undo records for the record, not to run them.
        kept = counted(len(stack), "undo record")
        parts.append(Text(f"  {kept} kept; the run completed, none will run"))
    elif stack:
        if status == "stuck":
            parts.append(Text("  past the pivot: a person decides about these", style="red"))
        for item in stack:
            parts.append(
                Text(f"  #{item['index']} {item['step']}: {_call(item)}  {item['description']}")
            )
    else:
        parts.append(Text("  (empty: nothing left to undo)", style="dim"))

    for d in view["dropped_spans"]:
        parts.append(
            Text(
                f"span dropped ({d['reason']}): {d['span'] or '?'} at {_when(d['at'])}"
                " — what it recorded is missing here",
                style="bold red",
            )
        )
    recovery = view["recovery"]
    if recovery:
        state = "released" if recovery["released"] else f"until {_when(recovery['expires_at'])}"
        parts.append(
            Text(
                f"recovery lease: {recovery['holder']} (token {recovery['token']}, {state})",
                style="dim",
            )
        )
        override = recovery["override"]
        if override:
            parts.append(
                Text(
                    f"FORCED behind a live agent by {override['by']} at "
                    f"{_when(override['at'])}: {override['reason']}",
                    style="bold yellow",
                )
            )
    escalation = view["escalation"]
    if escalation:
        # Text, not a str: rich would read the agent's "[link=...]" or "[/]" as markup.
        reason = Text(f"ESCALATED: {escalation['reason']}")
        parts.append(Rule(reason, align="left", style="red"))
        card = escalation["card"]
        if isinstance(card, dict) and card:
            # The card as the agent's own escalation prints it: one text rule for both.
            parts.append(Text(EscalationCard.from_dict(card).render()))
        else:
            parts.append(Text(f"(the agent's card was not an object: {json.dumps(card)})"))
    resolution = view["resolution"]
    if resolution:
        by = f" by {resolution['by']}" if resolution.get("by") else ""
        parts.append(Text(f"resolved {_when(resolution['at'])}{by}: {resolution['note']}", "green"))
    return _Drawing(parts, table)


class _Drawing:
    """The run's parts, its section rules as wide as the step table (at least 60
    columns): on a wide console (a pipe gets 200) they would otherwise run to its edge."""

    def __init__(self, parts: list[RenderableType], table: Table) -> None:
        self._parts, self._table = parts, table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(60, Measurement.get(console, options, self._table).maximum)
        for part in self._parts:
            yield Constrain(part, width) if isinstance(part, Rule) else part
