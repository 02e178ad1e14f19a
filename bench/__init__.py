"""Benchmarks: `make bench` (python -m bench) runs them all and rewrites docs/benchmarks.md."""
