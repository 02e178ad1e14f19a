"""Render docs/reliability.md from the chaos suite's last results (build/chaos-results.json).

``make chaos`` runs the suite and then this. The figures are whatever the
last run measured on this machine; the page says when and how to rerun.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "build" / "chaos-results.json"
OUT = ROOT / "docs" / "reliability.md"

SECTIONS = [
    (
        "agent_kill",
        "Agent kill",
        "A real agent process (forked from a zygote that imported everything once) runs a "
        "random refund-like saga, 40% of them failing at the end so some kills land inside "
        "the agent's own unwind; the test SIGKILLs it at a random moment inside the run. "
        "Ground truth: tools append to a file before returning, the agent after each "
        "`run.call` returned. The sidecar's stack must hold every compensation whose call "
        "had returned and nothing else but the step in flight; `recover()` from a new "
        "process then unwinds it.",
        "tests/chaos/test_agent_kill.py",
        "SAGA_CHAOS_AGENT_TRIALS",
    ),
    (
        "sidecar_kill",
        "Sidecar kill",
        "An agent runs 40 unwinding refunds; after 12 the sidecar is SIGKILLed and restarted "
        "on the same database and ports. Runs acknowledged before the kill must be there; "
        "the rest must arrive from the agent's retrying exporter; no alert is delivered "
        "twice across the crash and the restart's re-evaluation, but the one send the kill "
        "may cut between the receiver's accept and the outbox's mark (delivery is at least "
        "once; its first copy received before the restart, exactly twice).",
        "tests/chaos/test_outages.py",
        "",
    ),
    (
        "agent_kill_postgresql",
        "Agent kill (PostgreSQL)",
        "The agent-kill trials with the sidecar on PostgreSQL (`--db postgresql://...`, a "
        "server the test starts).",
        "tests/chaos/test_agent_kill.py",
        "SAGA_CHAOS_AGENT_TRIALS",
    ),
    (
        "sidecar_kill_postgresql",
        "Sidecar kill (PostgreSQL)",
        "The sidecar-kill run with the sidecar on PostgreSQL: the restarted sidecar reads "
        "the same database.",
        "tests/chaos/test_outages.py",
        "",
    ),
    (
        "replicas_kill_postgresql",
        "Replica kill (3 replicas, PostgreSQL)",
        "Three sidecar replicas on one PostgreSQL database; three agents send to all three "
        "in turn (a list of endpoints), a fourth keeps one run open across the kill, a fifth "
        "sends to one replica only and is SIGKILLed. One replica is SIGKILLed mid-load and "
        "restarted on its ports. Every acknowledged run must be whole, every run's view the "
        "same through each replica and as one SQLite sidecar folds the stored spans, each "
        "alert delivered once (a send the replica's kill cut between the receiver's accept "
        "and its record may come again, once), only the killed agent paged orphaned, and its "
        "run recovered through a replica that never received its spans.",
        "tests/chaos/test_replicas_kill.py",
        "",
    ),
    (
        "prune_kill",
        "Sidecar kill while pruning",
        "A database with 8,000 runs put away past the retention (4 spans each, some with "
        "marks, leases and alerts delivered and resolved, some with an alert still waiting "
        "for its sink) and 300 within it; a sidecar that prunes right after its start is "
        "SIGKILLed at a random moment inside the prune, up to 8 times, then one runs until "
        "the prune is done. After each kill every run must be whole (its index row, owner, "
        "all its spans, marks, lease and alerts) or gone, the runs within the retention and "
        "the waiting alerts untouched, and no pruned run back.",
        "tests/chaos/test_prune_kill.py",
        "",
    ),
    (
        "prune_kill_postgresql",
        "Sidecar kill while pruning (PostgreSQL)",
        "The same on PostgreSQL (batches taken with `FOR UPDATE SKIP LOCKED`).",
        "tests/chaos/test_prune_kill.py",
        "",
    ),
    (
        "upgrade_kill",
        "Sidecar kill while upgrading the schema",
        "A version-4 database with 150,000 runs (most put away); `saga-sidecar serve` "
        "upgrades it to the current version (from version 5 on: a flag on every put-away "
        "run's owner row, an index) and is SIGKILLed once the upgrade's transaction is under "
        "way, a random moment of it, up to 5 times, then started to the end. After each kill "
        "the database must be version 4 as it was or wholly upgraded (every put-away run "
        "flagged); the last start upgrades it.",
        "tests/chaos/test_upgrade_kill.py",
        "",
    ),
    (
        "upgrade_kill_postgresql",
        "Sidecar kill while upgrading the schema (PostgreSQL)",
        "The same on PostgreSQL (the upgrade's transaction under an advisory lock).",
        "tests/chaos/test_upgrade_kill.py",
        "",
    ),
    (
        "sink_outage",
        "Sink outage",
        "Five unwinding runs raise and resolve SagaCompensationStarted while the webhook "
        "sink is not listening; it comes back after the outage.",
        "tests/chaos/test_outages.py",
        "SAGA_CHAOS_OUTAGE_S",
    ),
    (
        "silent_sink",
        "Silent sink",
        "Two webhook sinks; one accepts every connection, reads the request and never "
        "answers (`--alert-timeout 120s`). Four unwinding runs raise and resolve "
        "SagaCompensationStarted. The other sink must get every alert while the silent one "
        "still holds its first request, the agent's runs must be acknowledged, the silent "
        "sink must get one request at a time; once it answers again on its port, every "
        "alert it missed arrives once, each resolve after its fire.",
        "tests/chaos/test_outages.py",
        "",
    ),
    (
        "stalled_database",
        "Stalled database (PostgreSQL)",
        "The sidecar's PostgreSQL backends are SIGSTOPped (a hung disk, a lock held by hand) "
        "while an agent's request waits for its commit. `/healthz` and `/metrics` must keep "
        "answering and show the wait (`intake_waiting_s`, "
        "`saga_sidecar_intake_waiting_seconds`, which `SagaSidecarIntakeStalled` watches); "
        "after SIGCONT the request is committed and answered 200 and the gauge is back to 0.",
        "tests/chaos/test_outages.py",
        "",
    ),
    (
        "stalled_replica_readiness",
        "Stalled replica's readiness (PostgreSQL)",
        "Two replicas on one PostgreSQL database (`--ready-stall 2s`); only replica a's "
        "backends are SIGSTOPped while an agent's request waits at it for its commit. "
        "Replica a must answer `/readyz` 503 (`intake_stalled`, with the fix) and "
        "`/healthz` 200 with `ready: false`; replica b must commit a new request meanwhile "
        "and answer `/readyz` 200. After SIGCONT a's request is committed and answered 200, "
        "b reads it, and a's `/readyz` is 200 again.",
        "tests/chaos/test_outages.py",
        "",
    ),
    (
        "fuzz",
        "Fuzzing the OTLP intake",
        "Hypothesis generates protobuf bodies (random bytes, valid requests with hostile "
        "attribute types, truncated and bit-flipped encodings) and JSON bodies (random JSON, "
        "OTLP-shaped JSON with wrong types), a share gzipped, against a live sidecar; then "
        "2,000 more requests check that resident memory stays flat once warm.",
        "tests/chaos/test_fuzz_intake.py",
        "SAGA_CHAOS_FUZZ",
    ),
    (
        "compensation_failures",
        "Compensation failures",
        "Randomized runs with a 30% transient failure rate on compensations (up to two "
        "failures per undo, four attempts) and, in a tenth of the runs, one undo that fails "
        "for good. Transient failures must be carried by retries; permanent ones must end "
        "`compensation_failed` and reach the escalation handler, never silently.",
        "tests/chaos/test_compensation_failures.py",
        "SAGA_CHAOS_RUNS",
    ),
    (
        "recovery_race",
        "Racing recoverers",
        "A real agent opens one run per trial (three undos each) and is SIGKILLed; per run, "
        "two `saga-otel recover` processes forked from a zygote wait at one barrier and start "
        "together. Ground truth: the undo tool logs every call and every effect. Exactly one "
        "process must hold the recovery lease and run each undo once; the other must exit 3 "
        "naming the holder.",
        "tests/chaos/test_recovery_race.py",
        "SAGA_CHAOS_RACE_TRIALS",
    ),
    (
        "slow_clients",
        "Slow clients",
        "200 HTTP connections send OTLP headers with `Content-Length: 100000` and one body "
        "byte, and 200 gRPC connections open an Export call and send no message, all "
        "against a real sidecar with `--max-in-flight 8` and `--body-timeout 3s`; meanwhile "
        "an agent exports runs over both transports with the OpenTelemetry SDK exporters. "
        "Every run must be stored, and every stall answered 408 / DEADLINE_EXCEEDED.",
        "tests/chaos/test_abuse.py",
        "",
    ),
    (
        "unauth_load",
        "Unauthenticated load",
        "A sidecar with `--token` gets 40 concurrent 15 MiB gRPC messages without the token, "
        "then 40 such HTTP requests (each sends its headers, must get its 401 before sending "
        "a body byte, then sends the 15 MiB anyway); its peak resident memory (VmHWM in "
        "/proc/PID/status) must grow by less than 64 MiB, every request must be refused, "
        "and the agent with the token must still get its spans stored.",
        "tests/chaos/test_abuse.py",
        "",
    ),
    (
        "idle_flood",
        "Idle connection flood",
        "1,100 connections that never send a byte go to the API port of a sidecar with "
        "`--token` and `--keepalive-timeout 10m` that may open 1,024 files; meanwhile an "
        "agent exports runs over both transports with the OpenTelemetry SDK exporters. "
        "Every run must be stored, the log must show no `Too many open files` (EMFILE) and "
        "the refused connections, and the API must answer again once the flood has gone.",
        "tests/chaos/test_abuse.py",
        "",
    ),
]


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in sorted(value.items()))
    return str(value)


def main() -> int:
    if not RESULTS.exists():
        print(f"no {RESULTS.relative_to(ROOT)}: run `make chaos` first", file=sys.stderr)
        return 1
    results = json.loads(RESULTS.read_text())
    lines = [
        "# Reliability",
        "",
        "What the chaos suite (`pytest -m chaos`, part of `make test` and CI) measured in its",
        "last full run on this machine. Every fault named here is injected by a test; each",
        "test fails if anything is lost, repeated or silent. Rerun with `make chaos`, which",
        "rewrites this page; raise the counts with the variables named below.",
        "",
        "| fault | what held | figures | run |",
        "|---|---|---|---|",
    ]
    for key, title, _how, _test, _env in SECTIONS:
        data = results.get(key)
        if data is None:
            lines.append(f"| {title} | not run | | |")
            continue
        figures = {k: v for k, v in data.items() if k not in ("at", "ci")}
        held = {
            "agent_kill": "0 lost, 0 duplicated, 0 out of order",
            "sidecar_kill": "no acknowledged span lost, no alert twice but the one send "
            "the kill may cut",
            "agent_kill_postgresql": "0 lost, 0 duplicated, 0 out of order",
            "sidecar_kill_postgresql": "no acknowledged span lost, no alert twice but the "
            "one send the kill may cut",
            "replicas_kill_postgresql": "no acknowledged span lost, views as one sidecar's, "
            "every alert delivered, none twice but the one send the kill may cut, "
            "no live agent paged",
            "prune_kill": "every run whole or gone after each kill; the prune finished",
            "prune_kill_postgresql": "every run whole or gone after each kill; the prune finished",
            "upgrade_kill": "version 4 as it was or wholly upgraded after each kill",
            "upgrade_kill_postgresql": "version 4 as it was or wholly upgraded after each kill",
            "sink_outage": "every alert delivered, once per dedup key and status",
            "silent_sink": "the other sink served meanwhile; every alert delivered once "
            "after it answered",
            "stalled_database": "the wait shown while stalled; nothing lost after",
            "stalled_replica_readiness": "the stalled replica out of rotation, the other "
            "ready; alive throughout; nothing lost after",
            "fuzz": "no crash, no 5xx, memory flat",
            "compensation_failures": "retries carried every transient failure; "
            "every permanent one escalated",
            "recovery_race": "one recoverer per run, each undo once, the loser named the holder",
            "slow_clients": "every agent export stored while 400 connections stalled; "
            "every stall cut",
            "unauth_load": "refused before reading; peak memory grew a few MiB",
            "idle_flood": "every agent export stored; no descriptor ran out; the flood's "
            "connections past the port's cap closed on arrival",
        }[key]
        lines.append(f"| {title} | {held} | {_fmt(figures)} | {data['at']} |")
    lines += ["", "## How each is run", ""]
    for _key, title, how, test, env in SECTIONS:
        knob = f" Scale: `{env}`." if env else ""
        lines.append(f"- **{title}** (`{test}`). {how}{knob}")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
