"""`python -m bench` with a wrong or help argument answers and never rewrites the docs."""

from __future__ import annotations

from pathlib import Path

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
