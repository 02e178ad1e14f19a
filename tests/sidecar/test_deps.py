"""Without its server stack the sidecar says, in one line, which extra to install.

``sys.modules[name] = None`` makes a module unimportable (and invisible to
``find_spec``) in a child interpreter, as on a library-only install;
tests/test_packaging.py checks the same against a real one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _without(modules: list[str], code: str) -> subprocess.CompletedProcess[str]:
    hide = "".join(f"sys.modules[{m!r}] = None; " for m in modules)
    return subprocess.run(
        [sys.executable, "-c", f"import sys; {hide}\n{code}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_saga_sidecar_names_the_missing_parts_and_the_extra_in_one_line() -> None:
    out = _without(["click", "rich"], "sys.argv = ['saga-sidecar', 'serve']\n"
                   "from sidecar._deps import main; main()")  # fmt: skip
    assert out.returncode == 1
    (line,) = out.stderr.splitlines()
    assert line == (
        "saga-sidecar: the sidecar needs click, rich, which are not installed: "
        "pip install 'saga-otel[sidecar]'"
    )


def test_the_package_imports_without_its_stack_and_its_names_say_what_is_missing() -> None:
    out = _without(
        ["aiohttp", "grpc"],
        "import sidecar\n"
        "try:\n    sidecar.Sidecar\nexcept ImportError as exc:\n    print(type(exc).__name__, exc)",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "MissingServerStackError the sidecar needs aiohttp, grpcio, which are not installed: "
        "pip install 'saga-otel[sidecar]'"
    )


def test_with_its_stack_the_command_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys; sys.argv = ['saga-sidecar', '--help']\n"
         "from sidecar._deps import main; main()"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "serve" in out.stdout and "runs" in out.stdout
