"""The export path's process-wide state, in one object.

Everything the export path shares across the process lives in :data:`STATE`:
the durable tickets (span id -> ticket), the set of runs open in this process
(named by heartbeats), the active :class:`~saga_otel._config.SidecarExport`,
this process's instance id, and the locks that guard them.

Tests call :meth:`ProcessState.reset` (after shutting down what they
configured) instead of reaching into fields. After ``os.fork()`` the child runs
:meth:`ProcessState.after_fork_in_child` (registered with
``os.register_at_fork``, as the OpenTelemetry SDK does for its batch
processor): a lock held by another parent thread at fork time would stay held
forever in the child, and the parent's threads, tickets and open runs are not
the child's.

This module is a leaf: the other export modules import it, it imports none of
them (what it calls on them is the small protocols below).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import uuid
from collections import deque
from typing import Final, Protocol

__all__ = ["STATE", "ActiveExport", "PendingTicket", "ProcessState"]

# Failed tickets nobody has waited for yet are kept so a late wait still sees
# the failure; this caps them (successes are removed at once).
MAX_FAILED_TICKETS: Final = 4096


class PendingTicket(Protocol):
    """What the state needs of a ticket (``saga_otel._acks.Ticket``)."""

    @property
    def span_id(self) -> int: ...

    @property
    def future(self) -> concurrent.futures.Future[str | None]: ...

    def lost_in_child(self) -> PendingTicket: ...


class ActiveExport(Protocol):
    """What the state needs of the active setup (``saga_otel._config.SidecarExport``)."""

    def ensure_heartbeat(self) -> None: ...

    def after_fork_in_child(self, parent_instance_id: str) -> None: ...


class ProcessState:
    """The export path's shared state; one instance, :data:`STATE`."""

    def __init__(self) -> None:
        self.instance_id = str(uuid.uuid4())
        self._fresh_locks()
        self.tickets: dict[int, PendingTicket] = {}
        self.failed_order: deque[int] = deque()
        self.open_runs: set[str] = set()
        self.active: ActiveExport | None = None
        self.atexit_registered = False
        # The exit flush as a multiprocessing finalizer (_config._exit_hooks): the
        # process whose finalizers hold it, and whether the children forked from
        # here are told to add their own.
        self.exit_finalizer_pid = 0
        self.after_forker = False

    def _fresh_locks(self) -> None:
        self.tickets_lock = threading.Lock()
        # Guards open_runs; the heartbeat thread waits on it for the first open run.
        self.runs_cond = threading.Condition()
        self.configure_lock = threading.Lock()

    def reset(self) -> None:
        """Forget tickets and open runs (for tests).

        Call it after shutting down what the test configured: it does not stop
        threads, it only clears what a previous test left behind so the next
        one starts from a fresh process's state. The instance id is kept.
        """
        with self.tickets_lock:
            self.tickets.clear()
            self.failed_order.clear()
        with self.runs_cond:
            self.open_runs.clear()
        self.active = None

    def after_fork_in_child(self) -> None:
        """Make the forked child a process of its own (runs in the child only).

        New locks and a new instance id; the parent's open runs are the
        parent's (its heartbeats keep naming them). A ticket inherited from the
        parent is replaced by one already resolved as lost: the child's sender
        will never send that span (the parent's does), so a wait on it in the
        child must not block or claim an acknowledgement. Finally the active
        setup restarts its sender and heartbeat threads, which fork did not copy.
        """
        self._fresh_locks()
        parent_id, self.instance_id = self.instance_id, str(uuid.uuid4())
        self.open_runs = set()
        self.failed_order = deque()
        self.tickets = {sid: t.lost_in_child() for sid, t in self.tickets.items()}
        self.failed_order.extend(self.tickets)
        active = self.active
        if active is not None:
            active.after_fork_in_child(parent_id)


STATE: Final = ProcessState()
os.register_at_fork(after_in_child=STATE.after_fork_in_child)
