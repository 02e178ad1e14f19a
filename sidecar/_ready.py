"""Readiness: whether this sidecar should be sent more requests (``GET /readyz``).

Liveness (``/healthz``) is answered while the process answers: restarting a sidecar
whose database is stalled frees nothing and drops the requests waiting for their
commit. Readiness is narrower: not while a request has waited longer than
``--ready-stall`` for its commit, so a load balancer or an orchestrator sends agents
to a replica that can commit. Each replica judges its own intake (a replica whose
connections are stuck is unready while the others stay ready).

There is no starting window to report: the API port is bound only once the state is
read back from the store (``Sidecar.start``), so a probe before that is refused by the
kernel, which probes count as a failure.

Pure: the API passes the wait it measured and the threshold.
"""

from __future__ import annotations

from typing import Literal, TypedDict

ReadyStatus = Literal["ready", "stalled"]
NotReadyReason = Literal["intake_stalled"]


class ReadyView(TypedDict):
    """The body of ``GET /readyz`` (200 when ``status`` is ready, else 503)."""

    status: ReadyStatus
    reason: NotReadyReason | None
    intake_waiting_s: float  # the oldest request still waiting for its commit; 0: none
    ready_stall_s: float  # --ready-stall: a wait past it is not ready
    fix: str | None


def readiness(waiting_s: float, stall_s: float) -> ReadyView:
    """Ready unless the oldest request has waited longer than ``stall_s`` for its commit.

    Strictly longer, as the ``SagaSidecarIntakeStalled`` rule compares (``> 5``): a wait
    of exactly the threshold is still ready.
    """
    shown = round(waiting_s, 3)
    if waiting_s <= stall_s:
        return {
            "status": "ready",
            "reason": None,
            "intake_waiting_s": shown,
            "ready_stall_s": stall_s,
            "fix": None,
        }
    return {
        "status": "stalled",
        "reason": "intake_stalled",
        "intake_waiting_s": shown,
        "ready_stall_s": stall_s,
        "fix": (
            f"a request has waited {waiting_s:.1f} s for this sidecar's database commit, "
            f"over --ready-stall {stall_s:g} s: send agents to another replica until it "
            "commits again; free the database (a lock or a blocked backend in "
            "pg_stat_activity, its disk, its connections): docs/operations.md, runbook "
            "SagaSidecarIntakeStalled"
        ),
    }


def is_ready(view: ReadyView) -> bool:
    return view["status"] == "ready"
