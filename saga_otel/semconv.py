"""Every span, attribute, metric and log event name of the saga span contract.

This is the one place these strings live. The library writes them, the sidecar
reads them, the dashboards and alert rules are checked against them. The
contract itself is ``docs/semantic-conventions.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final
from urllib.parse import quote

CONTRACT_VERSION: Final = 1

# --- resource -------------------------------------------------------------
SERVICE_NAME: Final = "service.name"
SERVICE_INSTANCE_ID: Final = "service.instance.id"
# Standard resource attributes the sidecar derives an instance from when a stream
# carries no service.instance.id (docs/semantic-conventions.md, "Identity").
HOST_NAME: Final = "host.name"
HOST_ID: Final = "host.id"
CONTAINER_ID: Final = "container.id"
K8S_POD_UID: Final = "k8s.pod.uid"
PROCESS_PID: Final = "process.pid"
PROCESS_CREATION_TIME: Final = "process.creation.time"

# --- identity (every span) ------------------------------------------------
SAGA_RUN_ID: Final = "saga.run.id"
SAGA_NAME: Final = "saga.name"
SAGA_CONTRACT_VERSION: Final = "saga.contract.version"
SAGA_PHASE: Final = "saga.phase"

# --- phases ---------------------------------------------------------------
PHASE_RUN: Final = "run"
PHASE_VALIDATE: Final = "validate"
PHASE_DO: Final = "do"
PHASE_UNWIND: Final = "unwind"
PHASE_COMPENSATE: Final = "compensate"
PHASE_ESCALATE: Final = "escalate"
PHASE_HEARTBEAT: Final = "heartbeat"
PHASES: Final = frozenset(
    {
        PHASE_RUN,
        PHASE_VALIDATE,
        PHASE_DO,
        PHASE_UNWIND,
        PHASE_COMPENSATE,
        PHASE_ESCALATE,
        PHASE_HEARTBEAT,
    }
)

# --- run ------------------------------------------------------------------
SAGA_RUN_STATUS: Final = "saga.run.status"
SAGA_RUN_FAILED_STEP: Final = "saga.run.failed_step"

# --- steps ----------------------------------------------------------------
SAGA_STEP_NAME: Final = "saga.step.name"
SAGA_STEP_INDEX: Final = "saga.step.index"
SAGA_STEP_CLASS: Final = "saga.step.class"
SAGA_STEP_ATTEMPT: Final = "saga.step.attempt"
SAGA_STEP_PIVOT: Final = "saga.step.pivot"

# --- compensation ---------------------------------------------------------
SAGA_COMPENSATION_TOOL: Final = "saga.compensation.tool"
SAGA_COMPENSATION_ARGS: Final = "saga.compensation.args"
SAGA_COMPENSATION_DESCRIPTION: Final = "saga.compensation.description"
# On a do span whose effect stands but whose undo could not be stored (not
# JSON, or over the size bound): the reason. The run cannot end compensated.
SAGA_COMPENSATION_UNSTORABLE: Final = "saga.compensation.unstorable"

# --- export markers and recovery ------------------------------------------
# A small span sent in place of one the sidecar refused as too large.
SAGA_EXPORT_DROPPED: Final = "saga.export.dropped"  # the reason (e.g. "too_large")
SAGA_EXPORT_DROPPED_SPAN: Final = "saga.export.dropped_span"  # the refused span's name
# ... and, on the same marker (see docs/semantic-conventions.md):
SAGA_EXPORT_DROPPED_SPAN_ID: Final = "saga.export.dropped_span_id"  # 16 hex digits
SAGA_EXPORT_DROPPED_SIZE: Final = "saga.export.dropped_size_bytes"  # its encoded size
SAGA_EXPORT_DROPPED_ATTRIBUTES: Final = "saga.export.dropped_attributes"  # keys left out
DROPPED_TOO_LARGE: Final = "too_large"  # over the sidecar's or the local size bound
DROPPED_REJECTED: Final = "rejected"  # the sidecar rejected it (OTLP partial success)
# The fencing token of the recovery lease a recoverer holds; on its spans.
SAGA_RECOVERY_TOKEN: Final = "saga.recovery.token"

# --- run ids ----------------------------------------------------------------
# A run id is data, never a path: 1..RUN_ID_MAX_CHARS characters for which
# str.isprintable() holds (letters, digits, punctuation, symbols and the ASCII
# space of any script; no control, format, separator, surrogate, private-use or
# unassigned code points). Clients put it in a URL as one encoded path segment.
RUN_ID_MAX_CHARS: Final = 256


def run_id_problem(run_id: object) -> str | None:
    """Why ``run_id`` is not a valid run id (naming the rule), or None when it is."""
    if not isinstance(run_id, str) or not run_id:
        return f"run id {run_id!r} is empty or not a string: use 1..{RUN_ID_MAX_CHARS} characters"
    if len(run_id) > RUN_ID_MAX_CHARS:
        return (
            f"run id {run_id[:40]!r}... has {len(run_id)} characters: use at most "
            f"{RUN_ID_MAX_CHARS}"
        )
    if not run_id.isprintable():
        bad = next(c for c in run_id if not c.isprintable())
        return (
            f"run id {run_id!r} contains the non-printable character U+{ord(bad):04X}: use "
            "printable characters only (no control, format or line-separator characters)"
        )
    if run_id in (".", ".."):
        # Encoded or not, a browser resolves a dot segment in a link: the run's page and
        # its alert's run_url would open another page.
        return f"run id {run_id!r} is a URL dot segment, which no link can address: use another id"
    return None


def run_id_segment(run_id: str) -> str:
    """``run_id`` as one URL path segment: every reserved byte percent-encoded.

    ``.`` and ``..`` are encoded too, or a client or proxy would collapse them as
    dot segments and address another resource.
    """
    segment = quote(run_id, safe="")
    return segment.replace(".", "%2E") if segment in (".", "..") else segment


def run_id_match_problem(
    given: str, known: Iterable[str], *, more: bool = False
) -> tuple[str | None, str | None]:
    """The one rule for naming a run by a prefix of its id, as people type it.

    ``known`` are run ids the sidecar has that start with ``given``; ``more``: the
    sidecar has more than those (its page was full). Returns ``(run_id, None)`` for
    ``given`` itself or its one match, else ``(None, problem)`` naming the candidates
    or saying none matched. ``given`` itself is best looked up first (``GET
    /runs/{id}``): among more runs than a page holds, it may not be in ``known``.
    """
    ids = sorted(set(known))
    if given in ids:
        return given, None
    if len(ids) == 1 and not more:
        return ids[0], None
    if not ids:
        return None, (
            f"no run {given!r}, and no run id starts with it: check the id with "
            "`saga-sidecar runs list` (finished runs are pruned after the retention)"
        )
    shown = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
    count = f"more than {len(ids)}" if more else str(len(ids))
    return None, f"run id prefix {given!r} matches {count} runs ({shown}): give more characters"


# --- unwind / escalate ----------------------------------------------------
SAGA_UNWIND_REASON: Final = "saga.unwind.reason"
SAGA_STACK: Final = "saga.stack"
SAGA_ESCALATION_REASON: Final = "saga.escalation.reason"
SAGA_ESCALATION_CARD: Final = "saga.escalation.card"

# --- heartbeat ------------------------------------------------------------
SAGA_HEARTBEAT_OPEN_RUNS: Final = "saga.heartbeat.open_runs"
SAGA_HEARTBEAT_INTERVAL_S: Final = "saga.heartbeat.interval_s"
# A beat too large for one span is sent as several (its parts), each naming some of the
# open runs: the beat's number (the same on every part, another on each beat) and how many
# parts it has. A heartbeat without them is a whole beat, as before they existed.
SAGA_HEARTBEAT_BEAT: Final = "saga.heartbeat.beat"
SAGA_HEARTBEAT_PARTS: Final = "saga.heartbeat.parts"

# --- OpenTelemetry GenAI conventions (tool calls) ---------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_OPERATION_EXECUTE_TOOL: Final = "execute_tool"
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
# The model's id for the tool call (optional; on do spans of calls a model made).
GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
# OpenTelemetry's general attribute: the failure's class, on a do/compensate span with status ERROR.
ERROR_TYPE: Final = "error.type"

# --- values ---------------------------------------------------------------
STATUS_COMPLETED: Final = "completed"
STATUS_COMPENSATED: Final = "compensated"
STATUS_COMPENSATION_FAILED: Final = "compensation_failed"
STATUS_STUCK: Final = "stuck"
STATUS_REJECTED: Final = "rejected"
RUN_END_STATUSES: Final = frozenset(
    {
        STATUS_COMPLETED,
        STATUS_COMPENSATED,
        STATUS_COMPENSATION_FAILED,
        STATUS_STUCK,
        STATUS_REJECTED,
    }
)
# States only the sidecar derives.
STATE_RUNNING: Final = "running"
STATE_UNWINDING: Final = "unwinding"
STATE_ORPHANED: Final = "orphaned"
STATE_RECOVERED: Final = "recovered"

STEP_CLASSES: Final = ("read", "convergent", "reversible", "compensable", "irreversible")

ESCALATION_COMPENSATION_FAILED: Final = "compensation_failed"
ESCALATION_STUCK: Final = "stuck"


# --- span names (low cardinality) ------------------------------------------
def run_span_name(saga: str) -> str:
    return f"saga.run {saga}"


def validate_span_name(step: str) -> str:
    return f"saga.validate {step}"


def do_span_name(step: str) -> str:
    return f"saga.do {step}"


def unwind_span_name(saga: str) -> str:
    return f"saga.unwind {saga}"


def compensate_span_name(step: str) -> str:
    return f"saga.compensate {step}"


def escalate_span_name(saga: str) -> str:
    return f"saga.escalate {saga}"


HEARTBEAT_SPAN_NAME: Final = "saga.heartbeat"

# --- agent metrics (prometheus-client adds _total to counters itself) -------
M_RUNS_STARTED: Final = "saga_runs_started_total"
M_RUNS_FINISHED: Final = "saga_runs_finished_total"
M_RUNS_IN_PROGRESS: Final = "saga_runs_in_progress"
M_STEPS: Final = "saga_steps_total"
M_STEP_DURATION: Final = "saga_step_duration_seconds"
M_STEP_RETRIES: Final = "saga_step_retries_total"
M_PIVOTS: Final = "saga_pivots_total"
M_UNWINDS: Final = "saga_unwinds_total"
M_COMPENSATIONS: Final = "saga_compensations_total"
M_COMPENSATION_FAILURES: Final = "saga_compensation_failures_total"
M_STUCK_RUNS: Final = "saga_stuck_runs_total"
M_EXPORT_FAILURES: Final = "saga_export_failures_total"
M_TELEMETRY_ERRORS: Final = "saga_telemetry_errors_total"

# --- sidecar metrics -------------------------------------------------------
# Labels: spans_received{transport=http|grpc, outcome=accepted|ignored|rejected|unavailable};
# runs{state}; request_duration{transport, route}; alerts{alertname, sink,
# outcome=delivered|retried|failed}; alert_delay{sink}. No run id, ever.
M_SIDECAR_SPANS_RECEIVED: Final = "saga_sidecar_spans_received_total"
M_SIDECAR_RUNS: Final = "saga_sidecar_runs"
M_SIDECAR_ORPHANED_RUNS: Final = "saga_sidecar_orphaned_runs"
M_SIDECAR_REQUEST_DURATION: Final = "saga_sidecar_request_duration_seconds"
M_SIDECAR_FORWARD_DROPPED: Final = "saga_sidecar_forward_dropped_spans_total"
M_SIDECAR_ALERTS: Final = "saga_sidecar_alerts_total"
M_SIDECAR_ALERT_DELAY: Final = "saga_sidecar_alert_delay_seconds"
M_SIDECAR_OUTBOX_DEPTH: Final = "saga_sidecar_outbox_depth"
# Alerts raised whose write to the outbox the database refused (a write lock held past
# the busy timeout, a full disk, PostgreSQL failing): held in memory and written once it
# answers. dropped: alerts lost unwritten (past the bound on those held, a bug, a stop
# while the database refused), raised again by the next start's re-evaluation if still open.
M_SIDECAR_ALERTS_UNWRITTEN: Final = "saga_sidecar_alerts_unwritten"
M_SIDECAR_ALERTS_DROPPED: Final = "saga_sidecar_alerts_dropped_total"
# How long the oldest OTLP request still waiting for its commit has waited (0: none):
# grows while the database is stalled (agents' acks time out meanwhile).
M_SIDECAR_INTAKE_WAITING: Final = "saga_sidecar_intake_waiting_seconds"
# spans_refused{transport, reason=bad_run_id|foreign_trace|not_owner|stale_token|
# conflicting_duplicate}: saga spans refused by the ownership, fencing and id rules
# (also counted as outcome=rejected in spans_received).
M_SIDECAR_SPANS_REFUSED: Final = "saga_sidecar_spans_refused_total"
# lease_requests{action=grant|renew|release, outcome=granted|forced|renewed|released|
# agent_alive|held|not_holder|unknown_run|bad_request}
M_SIDECAR_LEASE_REQUESTS: Final = "saga_sidecar_lease_requests_total"
# series_overflowed{metric}: increments of a saga_stream_* metric whose label sets (saga,
# service, step, tool names from the spans) had reached STREAM_MAX_SERIES: counted into
# its series whose every label is STREAM_OVERFLOW, so a stream of new names (a run id
# in a saga name, a hostile agent) cannot grow memory and /metrics without bound.
M_SIDECAR_SERIES_OVERFLOWED: Final = "saga_sidecar_series_overflowed_total"
# connections_refused{port=otlp_http|api}: connections closed on arrival because the port
# held --max-connections already (gRPC's port refuses inside grpc, uncounted).
M_SIDECAR_CONNECTIONS_REFUSED: Final = "saga_sidecar_connections_refused_total"
# Background tasks of the sidecar (alert delivery, orphan detection, ...) ended by an
# error since start: what they do has stopped until a restart.
M_SIDECAR_TASKS_FAILED: Final = "saga_sidecar_tasks_failed"
# Runs whose alerts the rules could not evaluate (a fault, logged naming the run): their
# alerts were not raised, the other runs' were.
M_SIDECAR_ALERT_EVALUATION_FAILURES: Final = "saga_sidecar_alert_evaluation_failures_total"
STREAM_MAX_SERIES: Final = 2000
STREAM_OVERFLOW: Final = "_overflow"

# --- saga metrics the sidecar derives from the spans it receives --------------
# The same story as the agent-side metrics above, for agents in any language: every
# one is labelled saga and service (never a run id). runs_finished{status=completed|
# compensated|compensation_failed|stuck|rejected|recovered}; compensations{step, tool,
# outcome=ok|failed}; compensation_failures{step}; pivots{step}; steps{step, phase,
# outcome=ok|error}; step_duration{step, phase}; step_retries{step, phase}.
M_STREAM_RUNS_STARTED: Final = "saga_stream_runs_started_total"
M_STREAM_RUNS_FINISHED: Final = "saga_stream_runs_finished_total"
M_STREAM_RUNS_IN_PROGRESS: Final = "saga_stream_runs_in_progress"
M_STREAM_RUNS_ORPHANED: Final = "saga_stream_runs_orphaned_total"
M_STREAM_UNWINDS: Final = "saga_stream_unwinds_total"
M_STREAM_UNWIND_DURATION: Final = "saga_stream_unwind_duration_seconds"
M_STREAM_COMPENSATIONS: Final = "saga_stream_compensations_total"
M_STREAM_COMPENSATION_FAILURES: Final = "saga_stream_compensation_failures_total"
M_STREAM_PIVOTS: Final = "saga_stream_pivots_total"
M_STREAM_STEPS: Final = "saga_stream_steps_total"
M_STREAM_STEP_DURATION: Final = "saga_stream_step_duration_seconds"
M_STREAM_STEP_RETRIES: Final = "saga_stream_step_retries_total"

# --- structlog events ------------------------------------------------------
EV_STEP_STARTED: Final = "saga.step.started"
EV_STEP_FINISHED: Final = "saga.step.finished"
EV_RUN_STARTED: Final = "saga.run.started"
EV_RUN_FINISHED: Final = "saga.run.finished"
EV_PIVOT: Final = "saga.pivot.crossed"
EV_UNWIND: Final = "saga.unwind.started"
EV_UNWIND_WAITING: Final = "saga.unwind.waiting"
EV_LATE_EFFECT: Final = "saga.effect.late"
EV_ESCALATION: Final = "saga.escalation"
EV_EXPORT_FAILED: Final = "saga.export.failed"
EV_EXPORT_FAILOVER: Final = "saga.export.failover"
EV_EXPORT_RECOVERED: Final = "saga.export.recovered"
EV_TELEMETRY_ERROR: Final = "saga.telemetry.error"
EV_CONFIGURE_WARNING: Final = "saga.configure.warning"

# --- alerts (sidecar) -------------------------------------------------------
ALERT_COMPENSATION_STARTED: Final = "SagaCompensationStarted"
ALERT_COMPENSATION_FAILED: Final = "SagaCompensationFailed"
ALERT_RUN_STUCK: Final = "SagaRunStuck"
ALERT_RUN_ORPHANED: Final = "SagaRunOrphaned"
