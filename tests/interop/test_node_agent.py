"""The Node.js example agent (examples/node_agent) against a real sidecar.

Over OTLP/proto, OTLP/JSON and OTLP/gRPC, with the JS SDK's SimpleSpanProcessor
and BatchSpanProcessor (its default 5 s delay; the agent flushes at every point
the contract orders): run states and stacks from the sidecar's API, every
stored span valid under the contract, the alerts at a webhook sink, the
SagaRunOrphaned page after kill -9, and no page while a paused agent lives;
a span the sidecar rejects is a failed ack, logged, and the SDK's attribute
limits from the environment never cut a saga span.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from support import AlertReceiver, SidecarProcess, start_sidecar, wait_until

from saga_otel import contract
from saga_otel import semconv as sc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROTOCOLS = ("http/protobuf", "http/json", "grpc")
PROCESSORS = ("simple", "batch")
COMBOS = [(p, q) for p in PROTOCOLS for q in PROCESSORS]
HEARTBEAT_S = 0.5  # the agent's interval here: the sidecar orphans after 3 missed
LIVE_BEATS = 8  # heartbeats a paused agent sends while the test watches for a false page
POSITIONAL_UNDO = Path(__file__).with_name("positional_undo.mjs")
# The JS SDK's limits from the environment, each with a value that cuts or drops saga attributes.
LIMITS = {
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "12",
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "12",
    "OTEL_ATTRIBUTE_COUNT_LIMIT": "6",
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "6",
}


@dataclass
class Setup:
    sidecar: SidecarProcess
    sink: AlertReceiver
    agent: Path
    protocol: str
    processor: str

    @property
    def endpoint(self) -> str:
        return f"http://{self.sidecar.grpc}" if self.protocol == "grpc" else self.sidecar.otlp

    def command(self, *args: str) -> list[str]:
        return [
            "node",
            str(self.agent),
            "--endpoint", self.endpoint,
            "--protocol", self.protocol,
            "--processor", self.processor,
            "--heartbeat-interval", str(HEARTBEAT_S),
            "--ack-timeout-ms", "5000",  # a shared CI machine: the bound, not a timing check
            *args,
        ]  # fmt: skip

    def view(self, run_id: str) -> dict[str, Any]:
        return run_view(self.sidecar, run_id)


def run_view(sidecar: SidecarProcess, run_id: str) -> dict[str, Any]:
    resp = httpx.get(f"{sidecar.api}/runs/{run_id}", timeout=10)
    assert resp.status_code == 200, (resp.status_code, resp.text)
    doc: dict[str, Any] = resp.json()
    return doc


def agent_log(text: str) -> list[dict[str, Any]]:
    """The agent's JSON lines (its log on stderr, its results on stdout)."""
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(params=COMBOS, ids=[f"{p}-{q}" for p, q in COMBOS])
def setup(request: pytest.FixtureRequest, node_agent: Path, tmp_path: Path) -> Iterator[Setup]:
    protocol, processor = request.param
    sink = AlertReceiver()
    # The rules' own delays off: each alert goes out as soon as the run's state says so.
    with start_sidecar(tmp_path, "--webhook", sink.url) as sidecar:
        yield Setup(sidecar, sink, node_agent, protocol, processor)
    sink.stop()


def _value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def stored_spans(sidecar: SidecarProcess, run_id: str) -> list[tuple[str, dict[str, object]]]:
    """(name, attributes) of every span the sidecar stored for the run, as received."""
    with sqlite3.connect(f"file:{sidecar.db}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT data FROM spans WHERE run_id = ?", (run_id,)).fetchall()
    out = []
    for (data,) in rows:
        span = Span.FromString(data)
        out.append((span.name, {kv.key: _value(kv.value) for kv in span.attributes}))
    return out


def run_agent(setup: Setup, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        setup.command(*args), capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "saga.export.failed" not in done.stderr, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    result: dict[str, Any] = next(doc for doc in lines if "status" in doc)
    return result


def test_states_stacks_spans_and_alerts(setup: Setup) -> None:
    runs = {
        "completed": run_agent(setup),
        "compensated": run_agent(setup, "--fail", "send_reply"),
        "compensation_failed": run_agent(
            setup, "--fail", "send_reply", "--undo-fail", "reverse_credit"
        ),
        "stuck": run_agent(setup, "--fail", "close_ticket"),
    }
    for want, agent in runs.items():
        assert agent["status"] == want
        view = setup.view(agent["run_id"])
        assert view["status"] == want
        assert view["saga"] == "refund"
        assert view["instance"] == agent["instance"]  # the agent's own, never ""
    assert len({a["instance"] for a in runs.values()}) == len(runs)

    def stack(status: str) -> list[tuple[str, str]]:
        return [(c["step"], c["tool"]) for c in setup.view(runs[status]["run_id"])["stack"]]

    both = [("set_ticket_status", "set_ticket_status"), ("issue_credit", "reverse_credit")]
    assert stack("completed") == both  # what would undo it, top first: nothing ran
    assert stack("compensated") == []
    assert stack("compensation_failed") == [("issue_credit", "reverse_credit")]
    assert stack("stuck") == both  # past the pivot nothing is undone
    undo = setup.view(runs["stuck"]["run_id"])["stack"]
    assert undo[0]["args"] == {"status": "open", "ticket_id": "T-9104"}
    assert undo[1]["args"]["credit_id"].startswith("cr_4921_")
    compensated = setup.view(runs["compensated"]["run_id"])
    assert compensated["failed_step"] == "send_reply"
    assert compensated["unwind_reason"] == "ServiceDown: send_reply: service unavailable (503)"
    assert [s["compensated"] for s in compensated["steps"]] == [False, True, True, False]
    assert setup.view(runs["stuck"]["run_id"])["escalation"]["reason"] == "stuck"

    # Every stored span keeps the whole contract, names included, and the GenAI attributes.
    for agent in runs.values():
        spans = stored_spans(setup.sidecar, agent["run_id"])
        assert spans
        for name, attrs in spans:
            assert contract.check(attrs, name, complete=True) == [], (name, attrs)
            if attrs[sc.SAGA_PHASE] in (sc.PHASE_DO, sc.PHASE_COMPENSATE):
                assert attrs[sc.GEN_AI_OPERATION_NAME] == sc.GEN_AI_OPERATION_EXECUTE_TOOL
                assert attrs[sc.GEN_AI_TOOL_NAME]
            if attrs[sc.SAGA_PHASE] == sc.PHASE_DO:
                assert str(attrs[sc.GEN_AI_TOOL_CALL_ID]).startswith("call_")
    failed = [
        attrs
        for _name, attrs in stored_spans(setup.sidecar, runs["compensation_failed"]["run_id"])
        if attrs.get(sc.ERROR_TYPE)
    ]
    assert {(a[sc.SAGA_PHASE], a[sc.ERROR_TYPE]) for a in failed} == {
        ("do", "ServiceDown"),
        ("compensate", "ServiceDown"),
    }
    assert sorted(a[sc.SAGA_STEP_ATTEMPT] for a in failed if a[sc.SAGA_PHASE] == "compensate") == [
        1,
        2,
        3,
    ]

    sink = setup.sink
    for status, alert in (
        ("compensated", sc.ALERT_COMPENSATION_STARTED),
        ("compensation_failed", sc.ALERT_COMPENSATION_FAILED),
        ("stuck", sc.ALERT_RUN_STUCK),
    ):
        run_id = runs[status]["run_id"]
        wait_until(lambda r=run_id, a=alert: sink.find(a, r), 30, f"{alert} for the {status} run")
    # The unwind reached the sidecar before the run ended, so the page fired, then resolved.
    run_id = runs["compensated"]["run_id"]
    wait_until(
        lambda: sink.find(sc.ALERT_COMPENSATION_STARTED, run_id, "resolved"),
        30,
        "SagaCompensationStarted resolved",
    )
    assert sink.find(sc.ALERT_RUN_ORPHANED, runs["completed"]["run_id"]) is None
    assert not [a for a in sink.alerts if a.get("run_id") == runs["completed"]["run_id"]]


class Agent:
    """A paused agent process whose stdout lines a thread hands over."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.err = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def next(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        while True:
            try:
                doc = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"the agent printed no {event!r} line") from None
            if doc.get("event") == event:
                return doc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.err.close()


def test_no_page_while_alive_then_orphaned_after_kill_9(setup: Setup, tmp_path: Path) -> None:
    agent = Agent(setup.command("--pause-after", "issue_credit"), tmp_path / "agent.err")
    try:
        paused = agent.next("paused")
        run_id = paused["run_id"]
        # The push was acknowledged before "paused": the sidecar holds the undo already.
        view = setup.view(run_id)
        assert view["status"] == "running"
        assert view["instance"] == paused["instance"]
        assert [(c["step"], c["tool"]) for c in view["stack"]] == [
            ("issue_credit", "reverse_credit")
        ]
        # Alive and paused for several heartbeat intervals (more than the 3 that orphan
        # a silent process): each heartbeat acknowledged, no page, still running.
        for _ in range(LIVE_BEATS):
            assert agent.next("heartbeat")["acked"] is True
        assert setup.view(run_id)["status"] == "running"
        assert setup.sink.find(sc.ALERT_RUN_ORPHANED, run_id) is None
    finally:
        agent.kill()
    assert agent.proc.returncode == -signal.SIGKILL
    page = wait_until(lambda: setup.sink.find(sc.ALERT_RUN_ORPHANED, run_id), 30, "SagaRunOrphaned")
    assert isinstance(page, dict) and page["severity"] == "critical"
    view = setup.view(run_id)
    assert view["status"] == "orphaned"
    assert view["stack"][0]["args"]["credit_id"].startswith("cr_4921_")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--protocol", "http/xml"], "use one of http/protobuf, http/json, grpc"),
        (["--processor", "eager"], "use simple or batch"),
        (["--heartbeat-interval", "0"], "must be > 0 seconds"),
    ],
)
def test_bad_options_get_one_line_naming_the_fix(
    node_agent: Path, args: list[str], says: str
) -> None:
    done = subprocess.run(
        ["node", str(node_agent), "--endpoint", "http://127.0.0.1:9", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_no_endpoint_gets_one_line_naming_the_fix(node_agent: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    done = subprocess.run(
        ["node", str(node_agent)], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--endpoint" in done.stderr, done.stderr


def test_a_span_the_sidecar_rejects_is_a_failed_ack_logged_with_its_message(setup: Setup) -> None:
    # The JS exporters call a partial success SUCCESS and tell only diag, silent by default.
    cmd = ["node", str(POSITIONAL_UNDO), setup.endpoint, setup.protocol, setup.processor]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout.splitlines()[-1])
    failed = [doc for doc in agent_log(done.stderr) if doc["event"] == "saga.export.failed"]
    do = [doc for doc in failed if doc["what"] == "do issue_credit"]
    assert len(do) == 1, done.stderr
    assert do[0]["reason"] == "rejected"
    assert do[0]["rejected"] == 1
    assert do[0]["spans"] == ["saga.do issue_credit"]
    assert do[0]["error"].startswith("1 saga span(s) rejected: saga.compensation.args=")
    assert "must be JSON object text" not in do[0]["error"]  # cut: the long value comes first
    assert len(do[0]["error"]) == 503 and do[0]["error"].endswith("...")
    if setup.processor == "simple":
        # One span per request: only the ack the rejected span stands in fails.
        assert failed == do, done.stderr
    # The run went on (telemetry never stops the agent); the sidecar never got the undo.
    assert run["status"] == "completed"
    view = setup.view(run["run_id"])
    assert view["status"] == "completed"
    assert view["stack"] == []
    assert [s["name"] for s in view["steps"]] == []


def test_attribute_limits_in_the_environment_never_cut_saga_spans(
    node_agent: Path, tmp_path: Path
) -> None:
    # The JS SDK applies them to every attribute: a cut undo or stack is rejected by the
    # sidecar, a cut run id names another run, a dropped attribute leaves a hole.
    base = {k: v for k, v in os.environ.items() if k not in LIMITS}
    with start_sidecar(tmp_path) as sidecar:
        for variable, value in LIMITS.items():
            done = subprocess.run(
                ["node", str(node_agent), "--endpoint", sidecar.otlp, "--ack-timeout-ms", "5000",
                 "--fail", "send_reply"],
                capture_output=True, text=True, timeout=60, env={**base, variable: value},
                check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            lines = agent_log(done.stderr)
            assert [doc["event"] for doc in lines] == ["saga.configure.warning"], done.stderr
            assert (lines[0]["variable"], lines[0]["value"]) == (variable, value)
            agent = next(doc for doc in agent_log(done.stdout) if "status" in doc)
            view = run_view(sidecar, agent["run_id"])
            assert view["status"] == "compensated", variable
            assert [(s["name"], s["compensated"]) for s in view["steps"]] == [
                ("get_order", False),
                ("issue_credit", True),
                ("set_ticket_status", True),
                ("send_reply", False),
            ], variable
            for name, attrs in stored_spans(sidecar, agent["run_id"]):
                assert contract.check(attrs, name, complete=True) == [], (variable, name, attrs)
