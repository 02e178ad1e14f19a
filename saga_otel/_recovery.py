"""recover(): finish the unwind of a run whose agent died, from another process.

The sidecar rebuilt the run's compensation stack from the spans the dead agent
had exported. Recovery first takes the run's recovery lease (refused while the
agent is alive, unless forced with a reason, and while another recoverer holds
it), then fetches the stack again under the lease, resolves each record's tool
by name in the caller's registry and unwinds it with the same retry policies,
emitting the compensate spans under the same run id, in the same trace and
with the lease's fencing token. Before and after each undo the lease is renewed
(one lost meanwhile stops the recovery, even if the undo ran); after a successful
undo, recovery waits until the sidecar shows it acknowledged before moving on,
so a recoverer that dies mid-unwind leaves the next one exactly the undos not
yet acknowledged. Each undo carries the same idempotency key every
time, for the window no fence closes (an undo that ran but whose span was lost).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from saga_otel import _heartbeat
from saga_otel import semconv as sc
from saga_otel._engine import Saga, SyncRun, _Core
from saga_otel._errors import ConfigurationError, RecoveryError
from saga_otel._leasing import (
    DEFAULT_LEASE_TTL_S,
    ApiTarget,
    HeldLease,
    RecoveryRefusedError,
    default_holder,
    take_lease,
)
from saga_otel._registry import ToolRegistry
from saga_otel.records import Compensation, RetryPolicy, SagaReport

ENV_SIDECAR_API = "SAGA_OTEL_SIDECAR_API"
DEFAULT_SIDECAR_API = "http://127.0.0.1:4320"
# How long recovery waits for the sidecar to show an undo acknowledged before it stops.
ACK_CONFIRM_TIMEOUT_S = 10.0

# What a finished run is, for the person who asked to recover it.
_FINISHED = {
    sc.STATUS_COMPLETED: "completed: every step succeeded, there is nothing to undo",
    sc.STATUS_COMPENSATED: "compensated: its agent undid every step itself",
    sc.STATUS_REJECTED: "rejected: pre-flight validation refused it before any write",
    sc.STATE_RECOVERED: "recovered: an earlier recovery finished its unwind",
}

__all__ = [
    "NothingToRecoverError",
    "OrphanedRunError",
    "RecoveryRefusedError",
    "fetch_run",
    "find_run_id",
    "recover",
]


class OrphanedRunError(RecoveryError):
    """The failure recorded for a run whose agent died: recovery unwinds on its behalf."""


class NothingToRecoverError(RecoveryError):
    """The run has nothing recovery may undo (it finished); nothing was done."""

    def __init__(self, message: str, *, status: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Hints:
    """How an error tells its caller to fix things: CLI flags or Python parameters."""

    sidecar: str
    tools: str
    force: str
    blocking: str


# A framework adapter's registry is async; recovery's unwind is sync.
_BLOCKING_FORMS = (
    "a framework adapter's SagaTools(...).blocking_registry() (pydantic-ai, LangChain, "
    "OpenAI Agents SDK), saga_otel.adapters.mcp.blocking_registry(connect, declare) for MCP, "
    "or sync functions of your own"
)
PYTHON_HINTS = Hints(
    sidecar=f"pass sidecar= (or set ${ENV_SIDECAR_API})",
    tools="pass the agent's own ToolRegistry (tools=...)",
    force="recover(..., force=True, reason='...')",
    blocking=f"pass a registry of blocking functions (tools=...): {_BLOCKING_FORMS}",
)
CLI_HINTS = Hints(
    sidecar=f"pass --sidecar URL (or set ${ENV_SIDECAR_API})",
    tools="point --tools at the agent's own registry (MODULE:NAME)",
    force="--force --reason '...'",
    blocking=f"point --tools at a registry of blocking functions: {_BLOCKING_FORMS}",
)


def _target(sidecar: str | None, token: str | None, hints: Hints) -> ApiTarget:
    base = (sidecar or os.environ.get(ENV_SIDECAR_API) or DEFAULT_SIDECAR_API).rstrip("/")
    parts = urlsplit(base)
    try:
        usable = parts.scheme in ("http", "https") and bool(parts.netloc) and parts.port != 0
    except ValueError:  # a port that is not a number in 1..65535
        usable = False
    if not usable:
        raise RecoveryError(
            f"{base!r} is not the sidecar's URL: give the scheme and address, e.g. "
            f"{DEFAULT_SIDECAR_API}; {hints.sidecar}"
        )
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return ApiTarget(base, headers, hints.sidecar)


def fetch_run(
    run_id: str, sidecar: str | None = None, *, token: str | None = None
) -> dict[str, Any]:
    """The sidecar's view of one run (``GET /runs/{id}``, the id encoded as one segment)."""
    return _fetch(_target(sidecar, token, PYTHON_HINTS), run_id)


def find_run_id(
    given: str, sidecar: str | None = None, *, token: str | None = None, cli: bool = False
) -> str:
    """The run id ``given`` names: itself when the sidecar knows it (``GET /runs/{id}``),
    else the one run id it is a prefix of (``GET /runs?id_prefix=``). People type the
    first characters of an id; both command lines (``saga-otel recover``,
    ``saga-sidecar runs ...``) take either.

    Raises `RecoveryError` naming the candidates when the prefix is ambiguous, and when
    no run matches.
    """
    api = _target(sidecar, token, CLI_HINTS if cli else PYTHON_HINTS)
    # A whole id first: more runs may start with it than one page of the prefix search holds.
    resp = api.call("GET", api.url(given))
    body = api.answer(resp, f"a request for run {given!r}")
    if resp.status == 200:
        return given
    if resp.status != 404:
        raise RecoveryError(
            f"the sidecar at {api.base} answered {resp.status} for run {given!r}: "
            f"{body['error'][:300]}"
        )
    resp = api.call("GET", f"{api.base}/runs", params={"id_prefix": given, "limit": 1000})
    body = api.answer(resp, "a run id lookup")
    if resp.status == 404:  # the API always has its run list: this is another port
        raise api.bad_answer(resp, "a run id lookup", f"no run list: {body['error'][:100]}")
    if resp.status != 200:
        raise RecoveryError(
            f"the sidecar at {api.base} answered {resp.status} to a run id lookup: "
            f"{body['error'][:300]}"
        )
    runs = body.get("runs")
    if not isinstance(runs, list) or not all(
        isinstance(r, dict) and isinstance(r.get("run_id"), str) for r in runs
    ):
        raise api.bad_answer(resp, "a run id lookup", '"runs" is not a list of runs with ids')
    more = body.get("next_cursor")  # a full page: more runs match than it holds
    if not isinstance(more, str | None):
        raise api.bad_answer(resp, "a run id lookup", 'a "next_cursor" that is not a text')
    run_id, problem = sc.run_id_match_problem(
        given, (r["run_id"] for r in runs), more=more is not None
    )
    if run_id is None:
        raise RecoveryError(f"{problem} (asked the sidecar at {api.base})")
    return run_id


def _fetch(api: ApiTarget, run_id: str) -> dict[str, Any]:
    # reveal=args: the real undo arguments, where the sidecar masks them for people.
    resp = api.call("GET", api.url(run_id), params={"reveal": "args"})
    what = f"a request for run {run_id!r}"
    view = api.answer(resp, what)
    if resp.status == 404:
        raise RecoveryError(
            f"the sidecar at {api.base} knows no run {run_id!r}; check the id with "
            "`saga-sidecar runs list`"
        )
    if resp.status != 200:
        raise RecoveryError(
            f"the sidecar at {api.base} answered {resp.status} for run {run_id!r}: "
            f"{view['error'][:300]}"
        )
    problem = _view_problem(view)
    if problem is not None:
        raise api.bad_answer(resp, what, problem)
    return view


def _view_problem(view: dict[str, Any]) -> str | None:
    """What makes ``view`` unlike a run view in the fields recovery reads, or None."""
    if not isinstance(view.get("status"), str):
        return 'no "status" text'
    for key in ("saga", "trace_id", "failed_step"):
        if not isinstance(view.get(key), str | None):
            return f'a "{key}" that is not a text'
    for key in ("stack", "steps"):
        items = view.get(key) or []
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            return f'a "{key}" that is not a list of objects'
    for key in ("pivot", "recovery"):
        if not isinstance(view.get(key), dict | None):
            return f'a "{key}" that is not an object'
    token = (view.get("recovery") or {}).get("token")
    if isinstance(token, bool) or not isinstance(token, int | None):
        return f'a lease "token" {token!r} that is not an integer'
    for item in view.get("stack") or []:
        try:
            Compensation.from_dict(item)
        except ConfigurationError as exc:
            return f"a stack entry that is {str(exc)[:200]}"
    return None


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
    force: bool = False,
    reason: str | None = None,
    lease_ttl: float = DEFAULT_LEASE_TTL_S,
    holder: str | None = None,
) -> SagaReport:
    """Unwind the stack the sidecar holds for ``run_id``; returns the recovery's report.

    Takes the run's recovery lease first: raises :class:`RecoveryRefusedError`
    while the run's agent is alive (unless ``force`` with a ``reason``, recorded
    on the run) or another recoverer holds the lease, and
    :class:`NothingToRecoverError` for a run that already finished. Refuses a
    run past its pivot (forward recovery or a person). A run with an empty
    stack is still closed, so the sidecar marks it recovered.
    """
    return recover_with_hints(
        run_id,
        tools=tools,
        sidecar=sidecar,
        token=token,
        retry=retry,
        tracer_provider=tracer_provider,
        registry=registry,
        logger=logger,
        view=view,
        force=force,
        reason=reason,
        lease_ttl=lease_ttl,
        holder=holder,
        hints=PYTHON_HINTS,
    )


def recover_with_hints(
    run_id: str,
    *,
    tools: ToolRegistry,
    sidecar: str | None,
    token: str | None,
    retry: RetryPolicy | None,
    tracer_provider: TracerProvider | None,
    registry: CollectorRegistry | None,
    logger: Any,
    view: dict[str, Any] | None,
    force: bool,
    reason: str | None,
    lease_ttl: float,
    holder: str | None,
    hints: Hints,
) -> SagaReport:
    """:func:`recover`, with its error messages worded for ``hints`` (the CLI's flags)."""
    if force and not (reason or "").strip():
        raise RecoveryError(
            f"forcing a recovery needs a reason, recorded on the run: {hints.force}"
        )
    api = _target(sidecar, token, hints)
    _check(run_id, view if view is not None else _fetch(api, run_id), tools, hints)
    lease = take_lease(
        api,
        run_id,
        holder=holder or default_holder(),
        ttl=lease_ttl,
        force=force,
        reason=reason,
        force_hint=hints.force,
    )
    try:
        # Under the lease: the stack less every undo the sidecar acknowledged.
        fresh = _fetch(api, run_id)
        _check(run_id, fresh, tools, hints)
        saga = Saga(
            str(fresh.get("saga") or "unknown"),
            tools=tools,
            retry=retry,
            tracer_provider=tracer_provider,
            registry=registry,
            logger=logger,
        )
        return _unwind(run_id, fresh, saga, lease, api, reason if force else None)
    finally:
        lease.release()


def _check(run_id: str, view: dict[str, Any], tools: ToolRegistry, hints: Hints) -> None:
    status = str(view.get("status", ""))
    stack = view.get("stack") or []
    if status in _FINISHED:
        raise NothingToRecoverError(
            f"run {run_id!r} is {_FINISHED[status]}; nothing to do", status=status
        )
    if status == sc.STATUS_COMPENSATION_FAILED and not stack:
        raise NothingToRecoverError(
            f"run {run_id!r} is compensation_failed with nothing left on its stack: what stands "
            "has no stored undo, so recovery cannot help; a person settles it, then "
            f"`saga-sidecar runs resolve {run_id!r} --note ...`",
            status=status,
        )
    if view.get("pivot") and stack:
        raise RecoveryError(
            f"run {run_id!r} crossed its pivot at {view['pivot'].get('step')!r}; its writes can "
            "no longer be undone safely. Finish it forward (idempotent retries) or settle it by "
            f"hand, then `saga-sidecar runs resolve {run_id!r} --note ...`"
        )
    missing = sorted({str(c.get("tool")) for c in stack if c.get("tool") not in tools})
    if missing:
        raise RecoveryError(
            f"run {run_id!r} needs the tools {', '.join(map(repr, missing))}, which the given "
            f"registry lacks; {hints.tools}"
        )
    # Refused before the lease: in recovery's sync unwind each would fail after it.
    async_tools = sorted({str(c["tool"]) for c in stack if tools.get(str(c["tool"])).is_async})
    if async_tools:
        raise RecoveryError(
            f"run {run_id!r} needs the tools {', '.join(map(repr, async_tools))}, which are async "
            f"in the given registry; recovery unwinds in sync code, where they cannot run: "
            f"{hints.blocking}"
        )


def _failure_text(run_id: str, view: dict[str, Any], forced_reason: str | None) -> str:
    status = str(view.get("status") or "orphaned")
    if forced_reason is not None:
        return (
            f"run {run_id} was {status}; a person forced its recovery behind an agent the "
            f"sidecar believed alive: {forced_reason}"
        )
    if status == sc.STATUS_COMPENSATION_FAILED and view.get("ended_at") is not None:
        failed = [
            str(s.get("name")) for s in view.get("steps") or [] if s.get("compensation_failed")
        ]
        return (
            f"run {run_id} ended compensation_failed (undo of {', '.join(failed) or 'a step'} "
            "failed); retrying the undos left on its stack from another process"
        )
    return (
        f"run {run_id} was {status}: its agent stopped before finishing; unwinding from "
        "another process"
    )


class _LeaseFence:
    """The recovery's fence around each undo: the lease is renewed before it, a
    successful undo is seen acknowledged by the sidecar, and the lease is renewed
    again before the next undo or the run's close."""

    def __init__(self, lease: HeldLease, api: ApiTarget, run_id: str) -> None:
        self.lease, self.api, self.run_id = lease, api, run_id

    def before(self) -> None:
        self.lease.check()

    def after(self, comp: Compensation, ok: bool) -> None:
        if ok:
            _confirm_undone(self.api, self.run_id, comp, self.lease)
        # An undo can outlast the lease (a pause past its ttl) while another recoverer
        # takes the run over, and the acknowledgement seen may be the other's: only a
        # renewal now proves the run is still this recovery's to go on with or close.
        self.lease.check(
            f"Its undo {comp.tool} of step #{comp.index} ({comp.step}) ended, but the run is "
            "no longer this process's: stopped without closing it"
        )


def _unwind(
    run_id: str,
    view: dict[str, Any],
    saga: Saga,
    lease: HeldLease,
    api: ApiTarget,
    forced_reason: str | None,
) -> SagaReport:
    stack = [Compensation.from_dict(item) for item in view.get("stack") or []]
    trace_hex = str(view.get("trace_id") or "")
    try:
        trace_id = int(trace_hex, 16) if trace_hex else 0
    except ValueError:
        trace_id = 0
    core = _Core(saga, run_id, trace_id=trace_id)
    run = SyncRun(core)
    core.open()
    tel = core.telemetry
    # The fencing token goes on every span of the recovery, the run span included.
    tel.identity[sc.SAGA_RECOVERY_TOKEN] = lease.token
    tel.span.set_attribute(sc.SAGA_RECOVERY_TOKEN, lease.token)
    assert core.state is not None
    core.state = replace(
        core.state,
        stack=tuple(reversed(stack)),  # the sidecar sends top first; the state keeps bottom first
        next_index=max((c.index for c in stack), default=-1) + 1,
        failed_step=view.get("failed_step") or None,
    )
    core.fence = _LeaseFence(lease, api, run_id)
    failure = OrphanedRunError(_failure_text(run_id, view, forced_reason))
    try:
        run.__exit__(OrphanedRunError, failure, None)
    except BaseException:
        if core.report is None:
            # The fence stopped the unwind: leave the run open for the next recoverer
            # (no run span, no verdict); it continues from what the sidecar acknowledged.
            _heartbeat.unregister_open_run(run_id)
        raise
    assert core.report is not None
    return core.report


def _confirm_undone(api: ApiTarget, run_id: str, comp: Compensation, lease: HeldLease) -> None:
    """Wait until the sidecar shows ``comp`` acknowledged as done, or stop the recovery.

    The exporter's ack says the request was answered, not that this span was kept
    (a fenced span is refused in partial success): the run view is the proof. A view
    whose lease token is another's means the lease was lost: the span was refused,
    so the wait stops at once (the caller's lease check reports it).
    """
    deadline = time.monotonic() + ACK_CONFIRM_TIMEOUT_S
    failed: RecoveryError | None = None
    while True:
        try:
            view = _fetch(api, run_id)
            failed = None
            held = (view.get("recovery") or {}).get("token")
            if held is not None and held != lease.token:
                return
            step = next((s for s in view.get("steps") or [] if s.get("index") == comp.index), None)
            if step is not None and step.get("compensated"):
                return
        except RecoveryError as exc:
            failed = exc  # the sidecar may be restarting: keep asking until the deadline
        if time.monotonic() > deadline:
            raise RecoveryError(
                f"run {run_id!r}: the undo {comp.tool} of step #{comp.index} ({comp.step}) ran, "
                f"but the sidecar did not show it acknowledged within {ACK_CONFIRM_TIMEOUT_S:g}s "
                "(its span was lost or refused; spans reach the sidecar only when "
                "saga_otel.configure() or --otlp points at it). Stopped so that no later "
                "undo runs on an unrecorded state; the next recovery repeats this undo under "
                "the same idempotency key"
                + (f". The last look at the run failed: {failed}" if failed is not None else "")
            )
        time.sleep(0.02)
