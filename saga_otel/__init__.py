"""saga-otel: a compensation stack for an agent's tool calls, observed from outside the agent.

On each successful write the saga pushes the operation that undoes it, holding
the references the write returned; on failure it unwinds in reverse, past no
pivot, loudly where an undo fails. Every step becomes OpenTelemetry spans,
structlog events and Prometheus metrics that a sidecar process can watch.
"""

from saga_otel._config import SidecarExport, configure
from saga_otel._engine import CallContext, Run, Saga, Step, SyncRun, current_call, idempotency_key
from saga_otel._errors import (
    ConfigurationError,
    RecoveryError,
    SagaError,
    StepRefusedError,
    UnknownToolError,
    ValidationRejectedError,
)
from saga_otel._metrics import start_metrics_server
from saga_otel._observe import ObservedRun, observed, observed_run
from saga_otel._recovery import (
    NothingToRecoverError,
    RecoveryRefusedError,
    fetch_run,
    find_run_id,
    recover,
)
from saga_otel._registry import CallInfo, Tool, ToolRegistry, tool
from saga_otel._telemetry import tool_call_id
from saga_otel.records import (
    Compensation,
    CompensationOutcome,
    EscalationCard,
    PendingCall,
    RetryPolicy,
    RunStatus,
    SagaReport,
    StepClass,
    StepRecord,
)

__version__ = "0.1.0"

__all__ = [
    "CallContext",
    "CallInfo",
    "Compensation",
    "CompensationOutcome",
    "ConfigurationError",
    "EscalationCard",
    "NothingToRecoverError",
    "ObservedRun",
    "PendingCall",
    "RecoveryError",
    "RecoveryRefusedError",
    "RetryPolicy",
    "Run",
    "RunStatus",
    "Saga",
    "SagaError",
    "SagaReport",
    "SidecarExport",
    "Step",
    "StepClass",
    "StepRecord",
    "StepRefusedError",
    "SyncRun",
    "Tool",
    "ToolRegistry",
    "UnknownToolError",
    "ValidationRejectedError",
    "configure",
    "current_call",
    "fetch_run",
    "find_run_id",
    "idempotency_key",
    "observed",
    "observed_run",
    "recover",
    "start_metrics_server",
    "tool",
    "tool_call_id",
]
