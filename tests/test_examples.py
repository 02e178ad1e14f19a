"""Every example runs, as a user would run it, and does what its docstring says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "SAGA_OTEL_LOG_LEVEL": "ERROR"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_refund_agent_example_unwinds_when_mail_is_down() -> None:
    out = run("examples.refund_agent", "--mail-down")
    assert ": compensated" in out
    assert "'amount': -2500" in out and "'reverses'" in out
    assert "'T-9104': 'open'" in out


def test_refund_agent_example_escalates_a_stuck_run() -> None:
    out = run("examples.refund_agent", "--close-fails")
    assert ": stuck" in out
    assert "You must decide" in out


def test_mcp_refund_agent_example_unwinds_through_the_mcp_tools() -> None:
    out = run("examples.mcp_refund_agent", "--mail-down")
    assert "reverse_credit(credit_id=result.credit_id)" in out  # the review came first
    assert ": compensated" in out and "'amount': -2500" in out and "'T-9104': 'open'" in out
    assert ": completed" in run("examples.mcp_refund_agent")


def test_pydantic_ai_refund_agent_example_unwinds_through_the_agents_tools() -> None:
    out = run("examples.pydantic_ai_refund_agent", "--mail-down")
    assert "reverse_credit(credit_id=result.credit_id)" in out  # the review came first
    assert ": compensated" in out and "'amount': -2500" in out and "'T-9104': 'open'" in out
    assert ": completed" in run("examples.pydantic_ai_refund_agent")


def test_langgraph_refund_agent_example_unwinds_through_the_langchain_tools() -> None:
    out = run("examples.langgraph_refund_agent", "--mail-down")
    assert "reverse_credit(credit_id=result.credit_id)" in out  # the review came first
    assert ": compensated" in out and "'amount': -2500" in out and "'T-9104': 'open'" in out
    assert ": completed" in run("examples.langgraph_refund_agent")


def test_openai_agents_refund_agent_example_unwinds_through_the_function_tools() -> None:
    out = run("examples.openai_agents_refund_agent", "--mail-down")
    assert "reverse_credit(credit_id=result.credit_id)" in out  # the review came first
    assert ": compensated" in out and "'amount': -2500" in out and "'T-9104': 'open'" in out
    assert ": completed" in run("examples.openai_agents_refund_agent")


def test_release_saga_example_validates_up_front() -> None:
    assert ": rejected" in run("examples.release_saga", "--bad-metadata")
    out = run("examples.release_saga", "--flag-down")
    assert ": compensated" in out and "'title': 'Old title'" in out
    assert ": completed" in run("examples.release_saga")


def test_own_runner_example_is_instrumented_in_under_ten_lines() -> None:
    out = run("examples.own_runner")
    assert out.startswith("compensated")
    source = (ROOT / "examples" / "own_runner.py").read_text()
    body = source.split("# --- the instrumentation: under ten lines", 1)[1]
    body = body.split('\n\nif __name__ == "__main__":', 1)[0]
    code = [line for line in body.splitlines()[1:] if line.strip()]
    assert len(code) < 10 + 1, code  # the def line plus under ten lines of body


def test_every_example_reaches_a_sidecar_through_the_environment(tmp_path: Path) -> None:
    """SAGA_OTEL_SIDECAR_ENDPOINT alone points each example at a real sidecar."""
    import json
    import urllib.request

    from saga_otel.testing import start_sidecar

    examples = {
        "examples.refund_agent": ("refund", ["--mail-down"]),
        "examples.release_saga": ("release", []),
        "examples.own_runner": ("refund", []),
        "examples.mcp_refund_agent": ("refund", ["--mail-down"]),
        "examples.pydantic_ai_refund_agent": ("refund", ["--mail-down"]),
        "examples.langgraph_refund_agent": ("refund", ["--mail-down"]),
        "examples.openai_agents_refund_agent": ("refund", ["--mail-down"]),
        "examples.metrics_agent": ("refund", ["--scenarios", "1", "--interval", "0"]),
    }
    with start_sidecar(tmp_path) as sc:
        for module, (saga, extra) in examples.items():
            env = {
                "PATH": "/usr/bin:/bin",
                "SAGA_OTEL_LOG_LEVEL": "ERROR",
                "SAGA_OTEL_SIDECAR_ENDPOINT": sc.otlp,
                "OTEL_SERVICE_NAME": module,
            }
            if module == "examples.metrics_agent":
                # It serves metrics until stopped: one round, then SIGTERM.
                proc = subprocess.Popen(
                    [sys.executable, "-m", module, *extra],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                assert proc.stdout is not None
                while "round 1" not in (proc.stdout.readline() or "round 1"):
                    pass
                proc.terminate()
                assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
            else:
                subprocess.run(
                    [sys.executable, "-m", module, *extra],
                    cwd=ROOT,
                    check=True,
                    timeout=120,
                    env=env,
                    capture_output=True,
                )
            with urllib.request.urlopen(f"{sc.api}/runs?limit=500", timeout=5) as resp:
                runs = json.load(resp)["runs"]
            services = {r.get("service") for r in runs if r["saga"] == saga}
            assert module in services, (module, runs)


FRAMEWORK_EXAMPLES = [
    "examples.mcp_refund_agent",
    "examples.pydantic_ai_refund_agent",
    "examples.langgraph_refund_agent",
    "examples.openai_agents_refund_agent",
]


def test_the_sidecar_shows_each_framework_run_as_it_shows_the_native_one(tmp_path: Path) -> None:
    """The same refund, native (run.call) and through each adapter, folds into one run view."""
    import httpx

    from saga_otel.testing import start_sidecar

    def shape(view: dict[str, object]) -> object:
        steps = [
            (s["name"], s["class"], s["pivot"], s["ok"], s["compensated"],
             (s["compensation"] or {}).get("tool"))
            for s in view["steps"]  # type: ignore[attr-defined]
        ]  # fmt: skip
        return view["status"], view["failed_step"], steps

    shapes = {}
    with start_sidecar(tmp_path) as sidecar:
        for module in ["examples.refund_agent", *FRAMEWORK_EXAMPLES]:
            env = {
                "PATH": "/usr/bin:/bin",
                "SAGA_OTEL_LOG_LEVEL": "ERROR",
                "SAGA_OTEL_SIDECAR_ENDPOINT": sidecar.otlp,
            }
            out = subprocess.run(
                [sys.executable, "-m", module, "--mail-down"],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
            ).stdout  # fmt: skip
            line = next(line for line in out.splitlines() if line.startswith("run "))
            run_id = line.split()[1].rstrip(":")
            shapes[module] = shape(httpx.get(f"{sidecar.api}/runs/{run_id}", timeout=5).json())
    native = shapes.pop("examples.refund_agent")
    assert native[0] == "compensated"  # type: ignore[index]
    assert shapes == {module: native for module in FRAMEWORK_EXAMPLES}
