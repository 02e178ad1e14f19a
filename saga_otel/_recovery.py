"""recover(): finish the unwind of a run whose agent died, from another process.

The sidecar rebuilt the run's compensation stack from the spans the dead agent
had exported. This fetches it, resolves each record's tool by name in the
caller's registry, and unwinds it with the same retry policies, emitting the
compensate spans under the same run id and in the same trace, so the sidecar
marks the run ``recovered`` (or ``compensation_failed``, escalated). Each
compensation is acknowledged by the sidecar as it succeeds, and carries the
same idempotency key every time, so recovering twice undoes nothing twice.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import httpx
from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from saga_otel import semconv as sc
from saga_otel._engine import Saga, SyncRun, _Core
from saga_otel._errors import RecoveryError
from saga_otel._registry import ToolRegistry
from saga_otel.records import Compensation, RetryPolicy, RunStatus, SagaReport

ENV_SIDECAR_API = "SAGA_OTEL_SIDECAR_API"
DEFAULT_SIDECAR_API = "http://127.0.0.1:4320"

# Runs in these states have nothing left that recovery may undo.
_FINISHED = {sc.STATUS_COMPLETED, sc.STATUS_COMPENSATED, sc.STATUS_REJECTED, sc.STATE_RECOVERED}


class OrphanedRunError(RecoveryError):
    """The failure recorded for a run whose agent died: recovery unwinds on its behalf."""


def fetch_run(
    run_id: str, sidecar: str | None = None, *, token: str | None = None
) -> dict[str, Any]:
    """The sidecar's view of one run (``GET /runs/{id}``)."""
    base = (sidecar or os.environ.get(ENV_SIDECAR_API) or DEFAULT_SIDECAR_API).rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        # reveal=args: the real arguments, which the sidecar masks in views for people.
        resp = httpx.get(
            f"{base}/runs/{run_id}", params={"reveal": "args"}, headers=headers, timeout=10.0
        )
    except httpx.HTTPError as exc:
        raise RecoveryError(
            f"cannot reach the sidecar at {base} ({type(exc).__name__}: {exc}); start it with "
            f"`saga-sidecar serve` or pass sidecar= / ${ENV_SIDECAR_API}"
        ) from exc
    if resp.status_code == 404:
        raise RecoveryError(
            f"the sidecar at {base} knows no run {run_id!r}; check the id with "
            "`saga-sidecar runs list`"
        )
    if resp.status_code != 200:
        raise RecoveryError(
            f"the sidecar at {base} answered {resp.status_code} for run {run_id!r}: "
            f"{resp.text[:300]}"
        )
    view: dict[str, Any] = resp.json()
    return view


def recover(
    run_id: str,
    *,
    tools: ToolRegistry,
    sidecar: str | None = None,
    token: str | None = None,
    retry: RetryPolicy | None = None,
    tracer_provider: TracerProvider | None = None,
    registry: CollectorRegistry | None = None,
    logger: Any = None,
    view: dict[str, Any] | None = None,
) -> SagaReport:
    """Unwind the stack the sidecar holds for ``run_id``; returns the recovery's report.

    Refuses a run past its pivot (there is nothing safe to undo: forward
    recovery or a person) and returns at once, doing nothing, for a run that
    is already finished. A run with an empty stack is still closed, so the
    sidecar marks it recovered.
    """
    view = view if view is not None else fetch_run(run_id, sidecar, token=token)
    status = str(view.get("status", ""))
    stack = [Compensation.from_dict(item) for item in view.get("stack") or []]
    saga = Saga(
        str(view.get("saga") or "unknown"),
        tools=tools,
        retry=retry,
        tracer_provider=tracer_provider,
        registry=registry,
        logger=logger,
    )
    if view.get("pivot") and stack:
        raise RecoveryError(
            f"run {run_id} crossed its pivot at {view['pivot'].get('step')!r}; its writes can no "
            "longer be undone safely. Finish it forward (idempotent retries) or settle it by "
            f"hand, then `saga-sidecar runs resolve {run_id} --note ...`"
        )
    if status in _FINISHED:
        # Already finished (perhaps by an earlier recovery): nothing is undone twice.
        return SagaReport(saga=saga.name, run_id=run_id, status=RunStatus.COMPENSATED, steps=())
    missing = sorted({c.tool for c in stack if c.tool not in tools})
    if missing:
        raise RecoveryError(
            f"run {run_id} needs the tools {', '.join(missing)}, which the given registry "
            "lacks; pass the agent's own ToolRegistry (tools=...)"
        )
    trace_hex = str(view.get("trace_id") or "")
    try:
        trace_id = int(trace_hex, 16) if trace_hex else 0
    except ValueError:
        trace_id = 0
    core = _Core(saga, run_id, trace_id=trace_id)
    run = SyncRun(core)
    core.open()
    assert core.state is not None
    core.state = replace(
        core.state,
        stack=tuple(reversed(stack)),  # the sidecar sends top first; the state keeps bottom first
        next_index=max((c.index for c in stack), default=-1) + 1,
        failed_step=view.get("failed_step") or None,
    )
    failure = OrphanedRunError(
        f"run {run_id} was {status or 'orphaned'}: its agent stopped before finishing; "
        "unwinding from another process"
    )
    run.__exit__(OrphanedRunError, failure, None)
    assert core.report is not None
    return core.report
