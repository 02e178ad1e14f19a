"""Run every benchmark and rewrite docs/benchmarks.md.

``python -m bench`` runs all ``bench/bench_*.py`` modules; ``python -m bench
observe export`` runs only those. Each figure is printed as it is measured.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

from bench._figures import Figure

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks.md"


def progress(text: str) -> None:
    print(f"  · {text}", flush=True)


def machine() -> list[str]:
    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "-"

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    libs = ", ".join(
        f"{p} {version(p)}"
        for p in (
            "saga-otel",
            "opentelemetry-sdk",
            "prometheus-client",
            "structlog",
            "aiohttp",
            "grpcio",
            "protobuf",
        )
    )
    return [
        f"- cores: {os.cpu_count()} ({cpu})",
        f"- Python {platform.python_version()} ({platform.python_implementation()}), "
        f"{platform.system()} {platform.release()}",
        f"- libraries: {libs}",
    ]


def render(figures: list[Figure], elapsed: float) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m bench`); do not edit by hand. Every figure",
        "stands beside a reference measured in the same run, on the same machine, with",
        "the same load generator; the ratio is what we hold ourselves to. Tests never",
        "assert times: these numbers live here only.",
        "",
        f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {elapsed:.0f} s in all.",
        "",
        "## Machine",
        "",
        *machine(),
        "",
        "## Figures",
        "",
        "| area | figure | value | reference | ratio | goal | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        lines.append(
            f"| {f.area} | {f.name} | {f.value:,.3f} {f.unit} | {f.reference_name}: "
            f"{f.reference_value:,.3f} {f.unit} | {f.ratio:.3f} | {f.goal} | "
            f"{('yes' if f.met else '**no**') if f.goal else '—'} |"
        )
    notes = [f for f in figures if f.notes]
    if notes:
        lines += ["", "## How each was measured", ""]
        for f in notes:
            lines.append(f"- **{f.area}: {f.name}.** {f.notes}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    names = sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))
    short = [n.removeprefix("bench_") for n in names]
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: python -m bench [NAME ...]\n  NAME: one of {', '.join(short)}")
        print("  with no NAME, runs them all and rewrites docs/benchmarks.md")
        return 0
    unknown = [a for a in argv if a not in short]
    if unknown:
        print(
            f"python -m bench: no benchmark named {', '.join(map(repr, unknown))}; "
            f"choose from {', '.join(short)}",
            file=sys.stderr,
        )
        return 2
    wanted = [n for n in names if not argv or n.removeprefix("bench_") in argv]
    figures: list[Figure] = []
    t0 = time.monotonic()
    failed = []
    for name in wanted:
        print(f"[{name}]", flush=True)
        started = time.monotonic()
        try:
            module = importlib.import_module(f"bench.{name}")
            got = module.run(progress)
        except Exception as exc:  # one broken bench must not hide the others' figures
            print(f"  ! {name} failed: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
            continue
        for f in got:
            mark = ("met" if f.met else "NOT met") if f.goal else "no goal"
            print(
                f"  = {f.name}: {f.value:,.3f} {f.unit} vs {f.reference_value:,.3f} "
                f"(ratio {f.ratio:.3f}, goal {f.goal}: {mark})",
                flush=True,
            )
        figures += got
        print(f"  ({time.monotonic() - started:.0f} s)", flush=True)
    if argv:  # a partial run never rewrites the docs
        print("partial run: docs/benchmarks.md left as is (run `make bench` for all)")
    elif failed:  # the docs would lose the failed benches' rows: keep the last full run's
        print(
            f"docs/benchmarks.md left as is: {', '.join(failed)} failed (see above); "
            "fix it and run `make bench` again"
        )
    else:
        OUT.write_text(render(figures, time.monotonic() - t0))
        print(f"wrote {OUT.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
