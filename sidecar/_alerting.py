"""The four per-run alerts, as a pure function of run views.

``evaluate(before, after, now)`` compares two views of one run (the shape in
docs/internals.md) and returns what changed: alerts to fire and alerts to
resolve. Nothing here does I/O, reads a clock or keeps state, so the rules can
be replayed over stored views after a crash and give the same answer.

Each alert is *open* in a view when the view shows its trigger and does not
show a clearing condition; an event is emitted when openness changes between
``before`` and ``after``. Because openness is a function of one view, fire and
resolve alternate for any sequence of views, and re-evaluating a view against
itself emits nothing.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final, Literal

from saga_otel import semconv as sc
from saga_otel.records import EscalationCard, is_pivot

from ._views import CompensationView, RunView, StepView

# Typed as the run view, read with .get(): the rules also run over views replayed
# from the outbox and views written by hand, which may lack keys.
View = RunView

SEVERITY_WARNING: Final = "warning"
SEVERITY_CRITICAL: Final = "critical"

DEFAULT_PUBLIC_URL: Final = "http://127.0.0.1:4320"
DEFAULT_RUNBOOK_BASE: Final = "https://github.com/saga-otel/saga-otel/blob/main/docs/operations.md"

# Statuses after which no person needs to act on the run: every open alert clears.
CLEARING_STATUSES: Final = frozenset(
    {sc.STATUS_COMPLETED, sc.STATUS_COMPENSATED, sc.STATE_RECOVERED}
)

SEVERITY_OF: Final[Mapping[str, str]] = {
    sc.ALERT_COMPENSATION_STARTED: SEVERITY_WARNING,
    sc.ALERT_COMPENSATION_FAILED: SEVERITY_CRITICAL,
    sc.ALERT_RUN_STUCK: SEVERITY_CRITICAL,
    sc.ALERT_RUN_ORPHANED: SEVERITY_CRITICAL,
}
ALERT_NAMES: Final = tuple(SEVERITY_OF)


class Action(StrEnum):
    FIRE = "fire"
    RESOLVE = "resolve"


@dataclass(frozen=True, slots=True)
class RuleConfig:
    """Where the links in an alert point. ``public_url`` is the sidecar API as people reach it."""

    public_url: str = DEFAULT_PUBLIC_URL
    runbook_base: str = DEFAULT_RUNBOOK_BASE
    # An unwind first seen together with the run's end (a batching exporter sent the
    # whole run at once) still fires SagaCompensationStarted, then resolves it at once.
    late_compensation: bool = True

    def run_url(self, run_id: str) -> str:
        return f"{self.public_url.rstrip('/')}/runs/{sc.run_id_segment(run_id)}"

    def runbook_url(self, alertname: str) -> str:
        return f"{self.runbook_base}#{alertname.lower()}"


@dataclass(frozen=True, slots=True)
class AlertEvent:
    """One alert firing or resolving for one run.

    ``at`` is when the thing the event reports happened (unwind start, run end,
    resolution), which the delay histogram measures from, never later than the
    sidecar's now when the event was built (an agent's clock may run ahead);
    ``starts_at`` is when the alert began (equal to ``at`` for a fire). ``details`` holds structured
    context (stack, card) for sinks that take JSON, never sent unredacted.
    """

    action: Action
    alertname: str
    run_id: str
    severity: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    at: float
    starts_at: float
    details: Mapping[str, Any] = field(default_factory=dict)
    # Which time this alert fires for the run (from 1): only SagaRunOrphaned fires again,
    # for a run orphaned anew after its agent was heard from (the outbox numbers them).
    episode: int = 1

    @property
    def dedup_key(self) -> str:
        return dedup_key(self.alertname, self.run_id, self.episode)

    @property
    def firing(self) -> bool:
        return self.action is Action.FIRE

    def resolving_with(self, fire: AlertEvent) -> AlertEvent:
        """This resolve carrying the labels and start of the fire it ends.

        Alertmanager matches a resolve to its alert by the full label set, so a
        resolve must repeat the fire's labels even when the view changed since.
        """
        return replace(
            self,
            labels=fire.labels,
            severity=fire.severity,
            starts_at=fire.starts_at,
            annotations={**fire.annotations, **_resolve_overrides(self.annotations)},
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action.value,
            "alertname": self.alertname,
            "run_id": self.run_id,
            "severity": self.severity,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "at": self.at,
            "starts_at": self.starts_at,
            "details": dict(self.details),
            "episode": self.episode,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AlertEvent:
        return cls(
            action=Action(data["action"]),
            alertname=str(data["alertname"]),
            run_id=str(data["run_id"]),
            severity=str(data["severity"]),
            labels={str(k): str(v) for k, v in dict(data["labels"]).items()},
            annotations={str(k): str(v) for k, v in dict(data["annotations"]).items()},
            at=float(data["at"]),
            starts_at=float(data["starts_at"]),
            details=dict(data.get("details") or {}),
            episode=int(data.get("episode") or 1),
        )


def _resolve_overrides(annotations: Mapping[str, str]) -> dict[str, str]:
    # A resolve keeps the fire's story but says how it ended.
    return {k: v for k, v in annotations.items() if k in ("resolution",)}


def dedup_key(alertname: str, run_id: str, episode: int = 1) -> str:
    """Stable per run and alert (and episode: see AlertEvent.episode): the same run never
    pages twice for one alert, on any sink, across restarts."""
    # The episode goes with the alert's name, never after the run id: a run id may hold
    # any printable character, "#2" included, and must not collide with another's key.
    name = alertname if episode <= 1 else f"{alertname}#{episode}"
    return f"saga-otel/{name}/{run_id}"


def episode_of(key: str) -> int:
    """The episode a :func:`dedup_key` names (1 for a key without one)."""
    name = key.split("/", 2)[1] if key.count("/") >= 2 else ""
    _, sep, n = name.partition("#")
    return int(n) if sep and n.isdigit() else 1


# --- predicates over one view -------------------------------------------------


def _status(view: View) -> str:
    return str(view.get("status") or "")


def _steps(view: View) -> list[StepView]:
    steps = view.get("steps") or []
    return [s for s in steps if isinstance(s, Mapping)]


def _escalation_reason(view: View) -> str | None:
    esc = view.get("escalation")
    if isinstance(esc, Mapping) and esc.get("reason"):
        return str(esc["reason"])
    return None


def _cleared(view: View) -> bool:
    return bool(view.get("resolution")) or _status(view) in CLEARING_STATUSES


def _triggered(alertname: str, view: View) -> bool:
    status = _status(view)
    if alertname == sc.ALERT_COMPENSATION_STARTED:
        return view.get("unwind_started_at") is not None or status == sc.STATE_UNWINDING
    if alertname == sc.ALERT_COMPENSATION_FAILED:
        return (
            status == sc.STATUS_COMPENSATION_FAILED
            or _escalation_reason(view) == sc.ESCALATION_COMPENSATION_FAILED
            or any(s.get("compensation_failed") for s in _steps(view))
        )
    if alertname == sc.ALERT_RUN_STUCK:
        # The escalation stays on the view, so a stuck run that a recovery process
        # picks up (status back to running) keeps its page until it completes.
        return status == sc.STATUS_STUCK or _escalation_reason(view) == sc.ESCALATION_STUCK
    if alertname == sc.ALERT_RUN_ORPHANED:
        return status == sc.STATE_ORPHANED
    raise ValueError(f"unknown alert {alertname!r}: use one of {', '.join(ALERT_NAMES)}")


def is_open(alertname: str, view: View | None) -> bool:
    """Whether ``alertname`` should be firing for the run this view shows."""
    if view is None:
        return False
    return _triggered(alertname, view) and not _cleared(view)


def open_alerts(view: View | None) -> tuple[str, ...]:
    return tuple(name for name in ALERT_NAMES if is_open(name, view))


# --- the rule function ----------------------------------------------------------


def evaluate(
    before: View | None,
    after: View,
    now: float,
    config: RuleConfig | None = None,
    *,
    replay: bool = False,
) -> list[AlertEvent]:
    """Alert events for the change ``before`` -> ``after`` of one run.

    ``before`` is None for a new run, or when the previous view is unknown (startup:
    then ``replay``, which raises no late alert, since that view was seen before).

    An alert of ``LATE_ALERTS`` whose trigger is first seen in a view that already
    clears it (a batching exporter delivered the unwind with the run's end) fires and
    resolves in one go, with a ``late`` annotation saying how late, unless
    ``config.late_compensation`` is off.
    """
    cfg = config or RuleConfig()
    events: list[AlertEvent] = []
    for name in ALERT_NAMES:
        was, now_open = is_open(name, before), is_open(name, after)
        if now_open and not was:
            events.append(build_event(Action.FIRE, name, after, now, cfg))
        elif was and not now_open:
            events.append(build_event(Action.RESOLVE, name, after, now, cfg))
        elif not replay and _seen_late(name, before, after, cfg):
            fire = _late(build_event(Action.FIRE, name, after, now, cfg), after, now)
            events.append(fire)
            events.append(_late(build_event(Action.RESOLVE, name, after, now, cfg), after, now))
    return events


# Alerts whose trigger may first be seen already cleared, and then fire late.
LATE_ALERTS: Final = frozenset({sc.ALERT_COMPENSATION_STARTED})


def _seen_late(name: str, before: View | None, after: View, cfg: RuleConfig) -> bool:
    """The trigger shows for the first time in a view whose run has already ended well.

    (A person's resolution also clears, but says nothing about batching: no late alert.)
    """
    return (
        cfg.late_compensation
        and name in LATE_ALERTS
        and (before is None or not _triggered(name, before))
        and _triggered(name, after)
        and _status(after) in CLEARING_STATUSES
    )


def lateness(view: View, now: float) -> float:
    """How long after the unwind began the sidecar first saw it (0 when it cannot say)."""
    started = _num(view.get("unwind_started_at"))
    return max(0.0, now - started) if started is not None else 0.0


def _late(event: AlertEvent, view: View, now: float) -> AlertEvent:
    late = lateness(view, now)
    note = (
        f"seen late: the spans arrived batched, {late:.1f} s after the unwind began, "
        f"together with the run's end ({_status(view) or '?'}); set the agent's exporter to "
        "send at once (SimpleSpanProcessor, or forceFlush) for this alert on time"
    )
    annotations = {
        **event.annotations,
        "description": f"{event.annotations.get('description', '')} ({note})",
        "late": note,
        "late_by_s": f"{late:.3f}",
    }
    if event.action is Action.RESOLVE:
        annotations["resolution"] = annotations["description"]
    return replace(
        event, annotations=annotations, details={**event.details, "late_by_s": round(late, 3)}
    )


def resolve_stale(
    fired: Sequence[str], view: View, now: float, config: RuleConfig | None = None
) -> list[AlertEvent]:
    """Resolves for alerts recorded as fired (``fired``: names) that ``view`` no longer holds open.

    Used on startup: a resolving change may have been committed just before a
    crash, after which ``before`` is lost and :func:`evaluate` cannot see it.
    """
    cfg = config or RuleConfig()
    return [
        build_event(Action.RESOLVE, name, view, now, cfg)
        for name in fired
        if name in SEVERITY_OF and not is_open(name, view)
    ]


# --- building the event -----------------------------------------------------------


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


# How far ahead of the sidecar an agent's clock may put an event before the alert says
# so: less is the usual spread of synchronized clocks plus the send, not worth a note.
CLOCK_AHEAD_NOTE_S: Final = 1.0


def _iso(ts: float) -> str:
    try:
        return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")
    except (OverflowError, ValueError, OSError):  # past year 9999: the number says it
        return f"{ts:.3f}"


def _event_time(action: Action, alertname: str, view: View, now: float) -> float:
    """When the reported thing happened, per the view; ``now`` when the view cannot say."""
    if action is Action.RESOLVE:
        resolution = view.get("resolution")
        if isinstance(resolution, Mapping) and _num(resolution.get("at")) is not None:
            return _num(resolution.get("at")) or now
        revived = view.get("revived")
        if alertname == sc.ALERT_RUN_ORPHANED and isinstance(revived, Mapping):
            at = _num(revived.get("at"))
            if at is not None and _status(view) != sc.STATE_ORPHANED:
                return at
        candidates = [view.get("ended_at"), view.get("updated_at")]
    elif alertname == sc.ALERT_COMPENSATION_STARTED:
        candidates = [view.get("unwind_started_at"), view.get("updated_at")]
    elif alertname == sc.ALERT_RUN_ORPHANED:
        # The sidecar decides orphanhood from silence, at evaluation time.
        candidates = []
    else:
        candidates = [view.get("ended_at"), view.get("updated_at")]
    for value in candidates:
        number = _num(value)
        if number is not None:
            return number
    return now


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one: "1 attempt", "2 attempts" (alert texts and
    the drawings)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _short(run_id: str) -> str:
    return run_id if len(run_id) <= 12 else run_id[:8] + "…"


def _last_error(step: StepView, key: Literal["attempts", "compensations"]) -> str | None:
    attempts = step.get(key) or []
    for attempt in reversed(attempts):
        if isinstance(attempt, Mapping) and attempt.get("error"):
            return str(attempt["error"])
    return None


def _step_label(view: View) -> str:
    if view.get("failed_step") or _card(view).get("failed_step"):
        return _failed_step(view)
    steps = _steps(view)
    if _status(view) == sc.STATE_ORPHANED and steps:
        # The step the agent was in when it went silent.
        last = max(steps, key=lambda s: int(s.get("index", -1)))
        return str(last.get("name") or "")
    return ""


def _card(view: View) -> Mapping[str, object]:
    escalation = view.get("escalation")
    card = escalation.get("card") if isinstance(escalation, Mapping) else None
    return card if isinstance(card, Mapping) else {}


def _failed_step(view: View) -> str:
    # The escalate span can arrive before the run span: its card names the step too.
    return str(view.get("failed_step") or _card(view).get("failed_step") or "?")


def _failure_text(view: View) -> str:
    if view.get("unwind_reason"):
        return str(view["unwind_reason"])
    failed = _failed_step(view)
    for step in _steps(view):
        if step.get("name") == failed:
            error = _last_error(step, "attempts")
            if error:
                return error
    return str(_card(view).get("error") or "unknown error")


def _comp_text(comp: CompensationView | Mapping[str, object]) -> str:
    return str(comp.get("description") or f"{comp.get('tool')}({comp.get('step')})")


def _not_undone(step: StepView) -> str:
    comp: CompensationView | Mapping[str, object] = step.get("compensation") or {}
    return (
        f"{_comp_text(comp)}: {_last_error(step, 'compensations')} "
        f"(tool {comp.get('tool')}, args {json.dumps(comp.get('args', {}), sort_keys=True)})"
    )


def build_card(alertname: str, view: View, run_url: str) -> dict[str, Any]:
    """What was done, what will be or was undone, what could not, and what a person decides.

    The view's own escalation card (from the agent's escalate span) wins when present.
    """
    card = _card(view)
    if card:
        return _with_override(dict(card), view)
    steps = _steps(view)
    stack = [c for c in (view.get("stack") or []) if isinstance(c, Mapping)]
    failed = [s for s in steps if s.get("compensation_failed")]
    done = [f"{s.get('name')} ({s.get('class')})" for s in steps if s.get("ok")]
    undone = [
        _comp_text(s.get("compensation") or {"tool": "?", "step": s.get("name")})
        for s in steps
        if s.get("compensated")
    ]
    not_undone = [_not_undone(s) for s in failed]
    irreversible = [
        str(s.get("name"))
        for s in steps
        if s.get("ok") and is_pivot(s.get("class"), s.get("pivot"))
    ]
    pending = [_comp_text(c) for c in stack]
    failed_step = view.get("failed_step")
    # As the commands below quote it: a run id may hold any printable character (a
    # space, `;`, `$(...)`) and a person pastes these lines into a shell.
    run_id = shlex.quote(str(view.get("run_id") or ""))
    if alertname == sc.ALERT_COMPENSATION_STARTED:
        decide = [
            f"Nothing yet: the agent is undoing {counted(len(pending), 'step')} by itself; act if "
            f"{sc.ALERT_COMPENSATION_FAILED} follows"
        ]
    elif alertname == sc.ALERT_COMPENSATION_FAILED:
        decide = [f"Undo by hand or accept: {text}" for text in not_undone] or [
            "Find which compensation failed in the run and undo it by hand or accept it"
        ]
    elif alertname == sc.ALERT_RUN_STUCK:
        decide = [
            f"Finish forward: retry {failed_step} and what follows (idempotent), or settle "
            f"by hand, then `saga-sidecar runs resolve {run_id} --note ...`",
            "Nothing was undone, because the run had crossed its pivot.",
        ]
    else:
        decide = [
            f"The agent died mid-run: from a process with its tools, `saga-otel recover "
            f"{run_id} --tools MODULE:REGISTRY` undoes the pending "
            f"{counted(len(stack), 'compensation')}; or undo by hand and "
            f"`saga-sidecar runs resolve {run_id} "
            f"--note ...` (API: POST {run_url}/resolve)"
        ]
    card = EscalationCard(
        saga=str(view.get("saga") or ""),
        run_id=str(view.get("run_id") or ""),
        reason=_status(view) or alertname,
        failed_step=str(failed_step) if failed_step else None,
        error=str(view["unwind_reason"]) if view.get("unwind_reason") else None,
        done=tuple(done),
        undone=tuple(undone),
        not_undone=tuple(not_undone),
        irreversible=tuple(irreversible),
        decide=tuple(decide),
    ).to_dict()
    card["will_undo"] = pending
    return _with_override(card, view)


def _with_override(card: dict[str, Any], view: View) -> dict[str, Any]:
    """A person forced a recovery behind an agent the sidecar believed alive: say so."""
    recovery = view.get("recovery")
    override = recovery.get("override") if isinstance(recovery, Mapping) else None
    if isinstance(override, Mapping):
        card["recovery_override"] = {"reason": override.get("reason"), "by": override.get("by")}
    return card


def render_card(card: Mapping[str, Any]) -> str:
    """The card as text for a person; tolerant of cards written by other agents."""
    text = EscalationCard.from_dict(card).render()
    pending = card.get("will_undo")
    if isinstance(pending, list) and pending:
        text += "\nWill be undone (top of stack first):\n" + "\n".join(f"  - {p}" for p in pending)
    override = card.get("recovery_override")
    if isinstance(override, Mapping):
        text += (
            f"\nRecovery was forced behind a live agent by {override.get('by')}: "
            f"{override.get('reason')}"
        )
    return text


def _describe(alertname: str, view: View, action: Action) -> tuple[str, str]:
    saga = str(view.get("saga") or "saga")
    run = _short(str(view.get("run_id") or "?"))
    failed = _failed_step(view)
    stack = view.get("stack") or []
    pending = f"{counted(len(stack), 'compensation')} pending"
    if action is Action.RESOLVE:
        resolution = view.get("resolution")
        revived = view.get("revived")
        if isinstance(resolution, Mapping) and resolution:
            by = resolution.get("by")
            who = f" ({by})" if isinstance(by, str) and by else ""  # the name they gave
            how = f"resolved by a person{who}: {resolution.get('note') or 'no note'}"
        elif (
            alertname == sc.ALERT_RUN_ORPHANED
            and isinstance(revived, Mapping)
            and _status(view) in (sc.STATE_RUNNING, sc.STATE_UNWINDING)
        ):
            late = (_num(revived.get("at")) or 0.0) - (_num(revived.get("orphaned_at")) or 0.0)
            how = (
                f"is {_status(view)} again: its agent was heard from {late:.1f} s after the "
                "orphan mark, so it was late, not dead (its spans arrive batched or delayed)"
            )
        else:
            how = f"run is {_status(view) or 'gone'}"
        return f"{saga} run {run}: {alertname} resolved", f"{saga} run {run} {how}"
    if alertname == sc.ALERT_COMPENSATION_STARTED:
        return (
            f"{saga} run {run} is compensating",
            f"{saga} run {run} unwinding after {failed} failed: {_failure_text(view)}; {pending}",
        )
    if alertname == sc.ALERT_COMPENSATION_FAILED:
        names = [str(s.get("name")) for s in _steps(view) if s.get("compensation_failed")]
        what = ", ".join(names) or "a step"
        return (
            f"{saga} run {run}: a compensation failed",
            f"{saga} run {run} could not undo {what} after {failed} failed: "
            f"{_failure_text(view)}; the effect is still live and needs a person",
        )
    if alertname == sc.ALERT_RUN_STUCK:
        return (
            f"{saga} run {run} is stuck past its pivot",
            f"{saga} run {run} stuck: {failed} failed after the point of no return "
            f"({_failure_text(view)}); finish it forward or settle by hand",
        )
    instance = view.get("instance") or "?"
    return (
        f"{saga} run {run} is orphaned",
        f"{saga} run {run} orphaned: its agent ({view.get('service') or '?'} {instance}) went "
        f"silent at step {_step_label(view) or '?'}; {pending}, recover or resolve it",
    )


def build_event(
    action: Action, alertname: str, view: View, now: float, config: RuleConfig
) -> AlertEvent:
    run_id = str(view.get("run_id") or "")
    severity = SEVERITY_OF[alertname]
    labels = {
        "alertname": alertname,
        "severity": severity,
        "saga": str(view.get("saga") or ""),
        "run_id": run_id,
        "service": str(view.get("service") or ""),
        "step": _step_label(view),
    }
    # Alertmanager treats an empty label as absent; leave it out so fire and resolve agree.
    labels = {k: v for k, v in labels.items() if v}
    run_url = config.run_url(run_id)
    summary, description = _describe(alertname, view, action)
    card = build_card(alertname, view, run_url)
    stack = list(view.get("stack") or [])
    annotations = {
        "summary": summary,
        "description": description,
        "escalation_card": json.dumps(card, sort_keys=True),
        "escalation_card_text": render_card(card),
        "run_url": run_url,
        "runbook_url": config.runbook_url(alertname),
        "stack": json.dumps(stack, sort_keys=True),
    }
    if action is Action.RESOLVE:
        annotations["resolution"] = description
    reported = _event_time(action, alertname, view, now)
    # The view's times are the agent's clock, which may run ahead of ours: an alert never
    # starts or ends later than now (Alertmanager refuses a start past its own now plus
    # resolve_timeout, and an end in the future keeps a resolved alert firing).
    at = min(reported, now)
    ahead = reported - now
    details: dict[str, Any] = {}
    if ahead > CLOCK_AHEAD_NOTE_S:
        note = (
            f"the agent's clock put this {ahead:.1f} s in the sidecar's future "
            f"({_iso(reported)}): the alert carries the sidecar's time; check the agent "
            "host's clock (NTP)"
        )
        annotations["agent_clock_ahead"] = note
        annotations["agent_clock_ahead_by_s"] = f"{ahead:.3f}"
        details["reported_at"] = reported
    return AlertEvent(
        action=action,
        alertname=alertname,
        run_id=run_id,
        severity=severity,
        labels=labels,
        annotations=annotations,
        at=at,
        starts_at=at,
        details={
            "status": _status(view),
            "saga": view.get("saga"),
            "service": view.get("service"),
            "instance": view.get("instance"),
            "failed_step": view.get("failed_step"),
            "unwind_reason": view.get("unwind_reason"),
            "stack": stack,
            "escalation_card": card,
            "run_url": run_url,
            "runbook_url": config.runbook_url(alertname),
            **details,
        },
    )
