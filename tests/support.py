"""Helpers shared by the test folders: real sidecar processes, bounded waits."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SidecarProcess:
    proc: subprocess.Popen[str]
    otlp: str
    grpc: str
    api: str
    db: Path
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_sidecar(tmp: Path, *args: str, db: Path | None = None) -> SidecarProcess:
    """``saga-sidecar serve`` on free loopback ports, its state in ``tmp``."""
    db = db or tmp / "sidecar.db"
    log = tmp / f"sidecar-{len(list(tmp.glob('sidecar-*.log')))}.log"
    cmd = [
        str(Path(sys.executable).parent / "saga-sidecar"),
        "serve",
        "--otlp-http-port", "0",
        "--otlp-grpc-port", "0",
        "--api-port", "0",
        "--db", str(db),
        "--no-alert-log",
        *args,
    ]  # fmt: skip
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == "sidecar.listening":
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return SidecarProcess(
                proc,
                otlp=f"http://127.0.0.1:{doc['otlp_http']}",
                grpc=f"127.0.0.1:{doc['otlp_grpc']}",
                api=f"http://127.0.0.1:{doc['api']}",
                db=db,
                log=log,
            )
    proc.wait()
    raise RuntimeError(f"the sidecar did not start: {log.read_text()[-2000:]}")


def wait_until(probe: Callable[[], object], timeout: float = 30.0, what: str = "") -> object:
    """Poll until ``probe()`` is truthy; a bounded wait, never a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting{' for ' + what if what else ''}")
        time.sleep(0.02)
