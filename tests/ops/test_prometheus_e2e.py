"""End to end: a real Prometheus scrapes a live refund agent and a live sidecar.

The agent (examples/metrics_agent.py) runs a completed, a compensated, a
compensation_failed and a stuck refund every round and exports its spans to the
sidecar; the sidecar delivers its alerts to a webhook served here. Prometheus
(scrape and rule evaluation every 1 s) loads alerts/saga-rules.yml. Then every
dashboard query must return a finite value, every metric the rules and the
dashboard name must be in the live /metrics output, and the rules must evaluate.

A second stack has no Python agent at all: the Node.js example agent feeds a
sidecar, Prometheus scrapes only the sidecar, and every panel must have data and
the saga rules must fire from the metrics the sidecar derives from the spans.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.ops.conftest import (
    REPO,
    RULES,
    dashboard_exprs,
    load_dashboard,
    load_rules,
    metric_names,
    substitute,
    tool,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

STARTUP_S = 60.0  # bound for a process to answer
DATA_S = 180.0  # bound for every panel to have data (needs a few scrapes after events)
RATE_INTERVAL = "15s"  # what Grafana's $__rate_interval is for a 1 s scrape interval


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode("utf-8"))


def _wait(
    what: str,
    check: Callable[[], Any],
    timeout: float,
    procs: list[_Proc],
    detail: Callable[[], str] = lambda: "",
) -> Any:
    """Poll ``check`` until it returns a truthy value; fail with the processes' logs."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        for proc in procs:
            proc.assert_alive()
        try:
            last = check()
            if last:
                return last
        except (OSError, urllib.error.URLError, ValueError) as exc:
            last = exc
        time.sleep(0.5)
    logs = "\n".join(proc.tail() for proc in procs)
    pytest.fail(f"timed out waiting for {what}; last: {last!r}\n{detail()}\n{logs}")


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, chars: int = 3000) -> str:
        text = self.log.read_text(encoding="utf-8", errors="replace")[-chars:]
        return f"--- {self.name} (end of {self.log}) ---\n{text}"

    def assert_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            pytest.fail(f"{self.name} exited with {code}\n{self.tail()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


def _start(name: str, args: list[str], tmp: Path) -> _Proc:
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return _Proc(name, popen, log)


class _Webhook(BaseHTTPRequestHandler):
    received: list[Any] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.received.append(json.loads(body or b"null"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None


@dataclass
class Stack:
    prometheus: str
    agent_metrics: str
    sidecar_metrics: str
    procs: list[_Proc]
    webhook: list[Any]

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = json.loads(_get(url))
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def api(self, path: str) -> Any:
        body = json.loads(_get(f"{self.prometheus}{path}"))
        assert body["status"] == "success", body
        return body["data"]


def _sidecar_args(tmp: Path, webhook: str) -> list[str]:
    exe = shutil.which("saga-sidecar", path=str(Path(sys.executable).parent))
    assert exe, "saga-sidecar is not installed in the venv: pip install -e '.[dev]'"
    ports = ("--otlp-http-port", "0", "--otlp-grpc-port", "0", "--api-port", "0")
    return [
        exe,
        "serve",
        "--host",
        "127.0.0.1",
        *ports,
        "--db",
        str(tmp / "sidecar.db"),
        "--webhook",
        webhook,
    ]


def _json_line(proc: _Proc, key: str, value: str) -> dict[str, Any] | None:
    """The first JSON object line of the process's output with ``key`` == ``value``."""
    for line in proc.log.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict) and doc.get(key) == value:
                    return doc
    return None


def _agent_port(proc: _Proc) -> int | None:
    """The port examples.metrics_agent printed (``metrics on http://127.0.0.1:P/metrics``)."""
    text = proc.log.read_text(encoding="utf-8", errors="replace")
    match = re.search(r"^metrics on http://127\.0\.0\.1:(\d+)/metrics$", text, re.M)
    return int(match.group(1)) if match else None


def _prometheus_config(tmp: Path, agent: str | None, sidecar: str) -> Path:
    shutil.copy(RULES, tmp / "saga-rules.yml")
    jobs = {"saga-agents": agent, "saga-sidecar": sidecar}
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["saga-rules.yml"],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [target]}]}
            for job, target in jobs.items()
            if target is not None
        ],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prometheus-e2e")
    procs: list[_Proc] = []
    _Webhook.received = []
    hook = ThreadingHTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    try:
        webhook = f"http://127.0.0.1:{hook.server_address[1]}/alerts"
        sidecar = _start("sidecar", _sidecar_args(tmp, webhook), tmp)
        procs.append(sidecar)
        listening = _wait(
            "the sidecar's listening line",
            lambda: _json_line(sidecar, "event", "sidecar.listening"),
            STARTUP_S,
            procs,
        )
        api, otlp_http = listening["api"], listening["otlp_http"]
        sidecar_metrics = f"http://127.0.0.1:{api}/metrics"
        _wait("the sidecar's /metrics", lambda: _get(sidecar_metrics), STARTUP_S, procs)

        agent_args = [
            sys.executable,
            "-m",
            "examples.metrics_agent",
            "--metrics-port",
            "0",
            "--sidecar",
            f"http://127.0.0.1:{otlp_http}",
            "--scenarios",
            "0",
            "--interval",
            "0.3",
        ]
        agent = _start("agent", agent_args, tmp)
        procs.append(agent)
        agent_port = _wait("the agent's metrics port", lambda: _agent_port(agent), STARTUP_S, procs)
        agent_metrics = f"http://127.0.0.1:{agent_port}/metrics"
        _wait("the agent's /metrics", lambda: _get(agent_metrics), STARTUP_S, procs)

        prom_port = free_port()
        config = _prometheus_config(tmp, f"127.0.0.1:{agent_port}", f"127.0.0.1:{api}")
        prom_args = [
            tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ]
        procs.append(_start("prometheus", prom_args, tmp))
        prometheus = f"http://127.0.0.1:{prom_port}"
        _wait("Prometheus to be ready", lambda: _get(f"{prometheus}/-/ready"), STARTUP_S, procs)
        yield Stack(prometheus, agent_metrics, sidecar_metrics, procs, _Webhook.received)
    finally:
        for proc in reversed(procs):
            proc.stop()
        hook.shutdown()
        hook.server_close()


def _finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


def test_both_targets_are_up(stack: Stack) -> None:
    def up() -> bool:
        result = stack.query("up")
        jobs = {s["metric"]["job"]: s["value"][1] for s in result}
        return jobs == {"saga-agents": "1", "saga-sidecar": "1"}

    _wait("both scrape targets up", up, DATA_S, stack.procs)


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    queries = [
        (title, substitute(expr, RATE_INTERVAL))
        for title, expr in dashboard_exprs(load_dashboard())
    ]
    missing: list[str] = []

    def all_have_data() -> bool:
        missing[:] = [f"{t}: {q}" for t, q in queries if not _finite(stack.query(q))]
        return not missing

    _wait(
        "every dashboard query to return a finite value",
        all_have_data,
        DATA_S,
        stack.procs,
        lambda: "panels without data:\n" + "\n".join(missing),
    )


def _families(url: str) -> set[str]:
    """Every series name a /metrics page can carry, including families with no samples yet."""
    names: set[str] = set()
    for family in text_string_to_metric_families(_get(url)):
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names |= {f"{family.name}{s}" for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
        names |= {sample.name for sample in family.samples}
    return names


def test_every_metric_used_is_exposed_live(stack: Stack) -> None:
    exposed = _families(stack.agent_metrics) | _families(stack.sidecar_metrics)
    exprs = [r["expr"] for r in load_rules()] + [e for _, e in dashboard_exprs(load_dashboard())]
    used = set().union(*(metric_names(e) for e in exprs)) - {"up"}
    assert used
    assert not used - exposed, f"not in any live /metrics: {sorted(used - exposed)}"


def test_rules_load_evaluate_and_match_live_series(stack: Stack) -> None:
    data = stack.api("/api/v1/rules")
    loaded = {r["name"]: r for g in data["groups"] for r in g["rules"]}
    assert set(loaded) == {r["alert"] for r in load_rules()}

    def evaluated_cleanly() -> bool:
        rules = [r for g in stack.api("/api/v1/rules")["groups"] for r in g["rules"]]
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not bad, f"rules failing to evaluate: {bad}"
        return all(r.get("lastEvaluation", "").startswith("20") for r in rules)

    _wait("every rule evaluated", evaluated_cleanly, DATA_S, stack.procs)

    # The scenarios fail compensations, get runs stuck and unwind half the runs, so
    # these rules must match the live label sets and be pending (or firing).
    expected = {"SagaCompensationFailuresHigh", "SagaStuckRunsHigh", "SagaCompensationRatioHigh"}

    def active() -> set[str]:
        alerts = stack.api("/api/v1/alerts")["alerts"]
        names = {a["labels"]["alertname"] for a in alerts}
        return names if expected <= names else set()

    names = _wait("live alerts to go pending", active, DATA_S, stack.procs)
    assert "SagaSidecarDown" not in names


def test_sidecar_delivered_alerts(stack: Stack) -> None:
    _wait("an alert at the webhook", lambda: stack.webhook, DATA_S, stack.procs)


# --- a sidecar fed by spans only: an agent in another language ------------------------------
# No saga_otel library and no agent /metrics: the Node.js example agent
# (examples/node_agent, official OpenTelemetry JS packages, OTLP/HTTP protobuf) runs a
# completed, a compensated, a compensation_failed and a stuck refund every round, and one
# it abandons mid-run (SIGKILLed: orphaned). Every dashboard panel must still have data.

_NODE_SCENARIOS: tuple[tuple[str, ...], ...] = (
    (),
    ("--fail", "send_reply"),
    ("--fail", "send_reply", "--undo-fail", "reverse_credit"),
    ("--fail", "close_ticket"),
)


class _NodeAgent:
    """A thread running the Node.js agent through the scenarios, round after round."""

    def __init__(self, endpoint: str, log: Path) -> None:
        from support import install_node_agent

        self.command = [
            "node", str(install_node_agent()), "--endpoint", endpoint,
            "--heartbeat-interval", "0.5", "--ack-timeout-ms", "5000",
        ]  # fmt: skip
        self.log = log
        self.stop = threading.Event()
        self.rounds = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        with self.log.open("a", encoding="utf-8") as out:
            while not self.stop.is_set():
                for args in _NODE_SCENARIOS:
                    subprocess.run(
                        [*self.command, *args], stdout=out, stderr=out, timeout=60, check=False
                    )
                paused = subprocess.Popen(
                    [*self.command, "--pause-after", "issue_credit"],
                    stdout=subprocess.PIPE,
                    stderr=out,
                    text=True,
                )
                assert paused.stdout is not None
                out.write(paused.stdout.readline())
                paused.kill()  # dies mid-run: the sidecar orphans it
                paused.wait(10)
                self.rounds += 1
                self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


@pytest.fixture(scope="module")
def spans_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prometheus-e2e-spans-only")
    procs: list[_Proc] = []
    received: list[Any] = []
    agent: _NodeAgent | None = None
    try:
        args = _sidecar_args(tmp, "http://127.0.0.1:9/unused")
        args[args.index("--webhook") : args.index("--webhook") + 2] = []
        sidecar = _start("sidecar", args, tmp)
        procs.append(sidecar)
        listening = _wait(
            "the sidecar's listening line",
            lambda: _json_line(sidecar, "event", "sidecar.listening"),
            STARTUP_S,
            procs,
        )
        api, otlp_http = listening["api"], listening["otlp_http"]
        sidecar_metrics = f"http://127.0.0.1:{api}/metrics"
        _wait("the sidecar's /metrics", lambda: _get(sidecar_metrics), STARTUP_S, procs)
        agent = _NodeAgent(f"http://127.0.0.1:{otlp_http}", tmp / "node-agent.log")
        prom_port = free_port()
        config = _prometheus_config(tmp, None, f"127.0.0.1:{api}")
        prom_args = [
            tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ]
        procs.append(_start("prometheus", prom_args, tmp))
        prometheus = f"http://127.0.0.1:{prom_port}"
        _wait("Prometheus to be ready", lambda: _get(f"{prometheus}/-/ready"), STARTUP_S, procs)
        yield Stack(prometheus, "", sidecar_metrics, procs, received)
    finally:
        if agent is not None:
            agent.close()
        for proc in reversed(procs):
            proc.stop()


def test_every_dashboard_panel_has_data_from_a_node_agent_only(spans_only: Stack) -> None:
    """The whole dashboard for a Node.js agent: no saga_otel, no /metrics of its own."""
    assert {s["metric"]["job"] for s in spans_only.query("up")} <= {"saga-sidecar"}
    queries = [
        (title, substitute(expr, RATE_INTERVAL))
        for title, expr in dashboard_exprs(load_dashboard())
    ]
    missing: list[str] = []

    def all_have_data() -> bool:
        missing[:] = [f"{t}: {q}" for t, q in queries if not _finite(spans_only.query(q))]
        return not missing

    _wait(
        "every dashboard query to return a finite value from spans only",
        all_have_data,
        DATA_S,
        spans_only.procs,
        lambda: "panels without data:\n" + "\n".join(missing),
    )
    # Labelled by the agent's service and saga, never by run id.
    series = spans_only.api('/api/v1/series?match[]={__name__=~"saga_stream_.*"}')
    assert series and all(s["service"] == "refund-agent-node" for s in series)
    assert not any("run_id" in s for s in series)


def test_saga_rules_fire_from_a_node_agent_only(spans_only: Stack) -> None:
    """The agents' trend rules work for any language (all but the library's export rule)."""
    expected = {"SagaCompensationFailuresHigh", "SagaStuckRunsHigh", "SagaCompensationRatioHigh"}

    def active() -> set[str]:
        alerts = spans_only.api("/api/v1/alerts")["alerts"]
        names = {a["labels"]["alertname"] for a in alerts}
        return names if expected <= names else set()

    names = _wait("the saga rules to go pending", active, DATA_S, spans_only.procs)
    assert "SagaSidecarDown" not in names
