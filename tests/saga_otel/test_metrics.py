"""The library's metric set (saga_otel._metrics): one per registry, also across a fork."""

from __future__ import annotations

from support import run_child

# A thread is building a metric set when the process forks: its registry's
# registrations wait for `go`, which a timer sets a moment later.
_FORK_MID_BUILD = r"""
import faulthandler, os, threading
from prometheus_client import CollectorRegistry
from saga_otel._metrics import metrics_for

class Held(CollectorRegistry):
    def __init__(self):
        super().__init__()
        self.entered = threading.Event()
        self.go = threading.Event()

    def register(self, collector):
        self.entered.set()
        self.go.wait(30)
        super().register(collector)

held = Held()
threading.Thread(target=metrics_for, args=(held,), daemon=True).start()
assert held.entered.wait(30)
threading.Timer(0.3, held.go.set).start()
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(10, exit=True)  # a hung child ends, showing where
    metrics_for(CollectorRegistry())  # another registry's set: the same module lock
    whole = metrics_for(held) is metrics_for(held)  # the parent's set, not built again
    os._exit(0 if whole else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_fork_while_another_thread_builds_a_metric_set_leaves_the_child_able_to_build() -> None:
    """The module lock is held across a fork: the fork waits for the set being built."""
    done = run_child(_FORK_MID_BUILD)
    assert done.returncode == 0, done.stderr
    # 1: the child hung on the lock (faulthandler's exit).
    assert done.stdout.strip() == "0", done.stderr
