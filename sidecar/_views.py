"""The run view and its parts, typed: the JSON of ``GET /runs/{id}`` (docs/internals.md).

Built by ``RunState`` and read by the alert rules, the renderer, the API and the
listeners. The keys are the wire format: change them only with the docs and the
API's clients.
"""

from __future__ import annotations

from typing import Final, Literal, TypedDict

EndStatus = Literal["completed", "compensated", "compensation_failed", "stuck", "rejected"]
"""What a run span says (``saga.run.status``)."""

RunStatus = Literal[
    "running",
    "unwinding",
    "completed",
    "compensated",
    "compensation_failed",
    "stuck",
    "rejected",
    "orphaned",
    "recovered",
]
"""A run's state in the sidecar: an end status, or one the sidecar derives."""

END_STATUSES: Final[dict[str, EndStatus]] = {
    "completed": "completed",
    "compensated": "compensated",
    "compensation_failed": "compensation_failed",
    "stuck": "stuck",
    "rejected": "rejected",
}
"""Text to :data:`EndStatus` (a lookup narrows a validated attribute to the Literal)."""


class AttemptView(TypedDict):
    attempt: int
    ok: bool
    error: str | None
    start: float
    end: float


class CompensationView(TypedDict):
    """One undo record: exactly ``saga_otel.Compensation.to_dict()``."""

    step: str
    index: int
    tool: str
    args: dict[str, object]
    description: str


# Functional form: "class" is a keyword.
StepView = TypedDict(
    "StepView",
    {
        "index": int,
        "name": str,
        "class": str | None,
        "pivot": bool,
        "ok": bool,
        "attempts": list[AttemptView],
        "compensation": CompensationView | None,
        "compensations": list[AttemptView],
        "compensated": bool,
        "compensation_failed": bool,
        # Why the undo of this successful step could not be stored (then the run
        # cannot end compensated); None when it was, or the step pushed none.
        "compensation_unstorable": str | None,
    },
)


class PivotView(TypedDict):
    step: str
    index: int


class EscalationView(TypedDict):
    reason: str
    card: object  # the agent's card as it sent it (JSON); {} when it was not JSON


class ResolutionView(TypedDict):
    """A person's resolution: their note, when, and who they said they are (``by``;
    None when they gave no name: the sidecar never invents one)."""

    note: str
    at: float
    by: str | None


class RevivedView(TypedDict):
    """The run was marked orphaned, then its agent was heard from again (late, not dead)."""

    orphaned_at: float
    at: float


class DroppedSpanView(TypedDict):
    """A marker span sent in place of a span the sidecar refused (``saga.export.dropped``)."""

    span: str
    reason: str
    at: float
    span_id: str


class OverrideView(TypedDict):
    """A person forced a recovery behind an agent the sidecar believed alive."""

    reason: str
    by: str
    at: float


class LeaseView(TypedDict):
    """The run's recovery lease (``POST /runs/{id}/lease`` answers with this)."""

    holder: str
    token: int
    granted_at: float
    expires_at: float
    released: bool
    override: OverrideView | None


class RunView(TypedDict):
    run_id: str
    saga: str
    service: str
    instance: str
    trace_id: str
    status: RunStatus
    started_at: float | None
    updated_at: float
    ended_at: float | None
    failed_step: str | None
    unwind_reason: str | None
    unwind_started_at: float | None
    pivot: PivotView | None
    steps: list[StepView]
    stack: list[CompensationView]
    escalation: EscalationView | None
    resolution: ResolutionView | None
    dropped_spans: list[DroppedSpanView]
    recovery: LeaseView | None
    revived: RevivedView | None


class RunSummary(TypedDict):
    """One row of ``GET /runs``."""

    run_id: str
    saga: str
    service: str
    instance: str
    status: RunStatus
    started_at: float | None
    updated_at: float
    ended_at: float | None
    failed_step: str | None
    stack_depth: int
    resolved: bool
