"""`python -m bench` with a wrong or help argument answers and never rewrites the docs;
a full run with a failed bench keeps the last full run's docs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import __main__ as bench_main


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    target = tmp_path / "benchmarks.md"
    target.write_text("kept\n")
    monkeypatch.setattr(bench_main, "OUT", target)
    return target


def test_help_lists_the_benches_and_writes_nothing(
    out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_main.main(["--help"]) == 0
    said = capsys.readouterr().out
    assert "observe" in said and "sidecar" in said
    assert out.read_text() == "kept\n"


def test_an_unknown_name_is_named_with_the_choices(
    out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_main.main(["observe", "nope"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "choose from" in err and "liverun" in err
    assert out.read_text() == "kept\n"


def test_a_failed_bench_keeps_the_last_full_runs_docs(
    out: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(_progress: Any) -> list[Any]:
        raise RuntimeError("the reference server did not start")

    def load(name: str) -> SimpleNamespace:
        if name == "bench.bench_observe":
            return SimpleNamespace(run=broken)
        return SimpleNamespace(run=lambda _progress: [])

    monkeypatch.setattr(bench_main.importlib, "import_module", load)
    assert bench_main.main([]) == 1
    said = capsys.readouterr().out
    assert "bench_observe failed" in said and "left as is" in said
    assert out.read_text() == "kept\n"
