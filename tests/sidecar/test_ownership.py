"""A run belongs to the trace and instance that opened it; leases fence recoverers;
run ids are data; conflicting duplicates resolve the same live and after a restart."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import ReadableSpan
from sidecar_testkit import (
    BOTH_BACKENDS,
    CREDIT,
    FakeClock,
    RunScript,
    compensated_run,
    database_clock_passes,
    heartbeat_spans,
    open_run,
    rejoin,
    settings_for,
)

from saga_otel import semconv as sc
from sidecar import Sidecar
from sidecar._backends import open_store
from sidecar._otlp import extract, parse_protobuf
from sidecar._render import render_run

pytestmark = BOTH_BACKENDS


async def post(sidecar: Sidecar, spans: list[ReadableSpan]) -> ExportTraceServiceResponse:
    body = encode_spans(spans).SerializeToString()
    async with httpx.AsyncClient() as client:
        resp = await client.post(
            f"http://127.0.0.1:{sidecar.otlp_http_port}/v1/traces",
            content=body,
            headers={"Content-Type": "application/x-protobuf"},
        )
    assert resp.status_code == 200, resp.text
    return ExportTraceServiceResponse.FromString(resp.content)


async def api(sidecar: Sidecar, method: str, path: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.request(
            method, f"http://127.0.0.1:{sidecar.api_port}{path}", timeout=10, **kw
        )


def refused(sidecar: Sidecar, reason: str) -> float:
    value = sidecar.metrics.registry.get_sample_value(
        sc.M_SIDECAR_SPANS_REFUSED, {"transport": "http", "reason": reason}
    )
    return value or 0.0


def with_attrs(span: ReadableSpan, **changes: Any) -> ReadableSpan:
    """The same span id with other content (a conflicting duplicate)."""
    attrs = {**(span.attributes or {}), **{k.replace("_", "."): v for k, v in changes.items()}}
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=attrs,
        events=span.events,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


async def test_a_stranger_cannot_take_a_run_over(sidecar: Sidecar) -> None:
    owner = open_run(instance="agent-1")
    await post(sidecar, owner.spans())
    before = sidecar.state.view(owner.run_id)
    assert before is not None
    # Another trace, another process, an earlier start and an undo of its choosing.
    intruder = RunScript(instance="intruder", run_id=owner.run_id, t0=1_600_000_000.0)
    intruder.do(5, "wipe", "compensable", comp=("delete_account", {"id": "c-77"}, "delete it"))
    answer = await post(sidecar, intruder.spans())
    assert answer.partial_success.rejected_spans == 1
    assert "belongs to trace" in answer.partial_success.error_message
    assert refused(sidecar, "foreign_trace") == 1
    assert sidecar.state.view(owner.run_id) == before  # owner, trace, stack, times unchanged

    # Same trace (copied from the view), other instance, no lease token: refused too.
    copycat = RunScript(instance="copycat", run_id=owner.run_id)
    copycat.do(6, "wipe", "compensable", comp=("delete_account", {"id": "c-77"}, "delete it"))
    spans = [with_attrs(s) for s in copycat.spans()]
    same_trace = [
        ReadableSpan(
            name=s.name,
            context=s.context.__class__(
                int(before["trace_id"], 16), s.context.span_id, False, s.context.trace_flags
            ),
            resource=s.resource,
            attributes=s.attributes,
            start_time=s.start_time,
            end_time=s.end_time,
            status=s.status,
        )
        for s in spans
    ]
    answer = await post(sidecar, same_trace)
    assert answer.partial_success.rejected_spans == 1
    assert "holds no recovery lease" in answer.partial_success.error_message
    assert refused(sidecar, "not_owner") == 1
    # A stranger's heartbeat naming the run does not keep it from being orphaned.
    await post(sidecar, heartbeat_spans("intruder", [owner.run_id], at=0.0))
    assert sidecar.state.view(owner.run_id) == before


async def test_lease_refused_behind_a_live_agent_granted_once_orphaned_and_fenced(
    sidecar: Sidecar, clock: FakeClock
) -> None:
    run = open_run(instance="agent-1")
    await post(sidecar, run.spans())
    path = f"/runs/{sc.run_id_segment(run.run_id)}/lease"
    alive = await api(sidecar, "POST", path, json={"holder": "rec-a"})
    assert alive.status_code == 409
    body = alive.json()
    assert body["reason"] == "agent_alive" and body["last_heard"] == clock.now
    assert "last heard from" in body["error"] and "--force --reason" in body["error"]

    bad = await api(sidecar, "POST", path, json={"holder": "rec-a", "force": True})
    assert bad.status_code == 400 and "reason" in bad.json()["error"]

    clock.now += sidecar.settings.idle_timeout + 1
    sidecar.tick()
    first = await api(sidecar, "POST", path, json={"holder": "rec-a", "ttl_s": 5})
    assert first.status_code == 200, first.text
    assert first.json()["token"] == 1
    held = await api(sidecar, "POST", path, json={"holder": "rec-b"})
    assert held.status_code == 409 and held.json()["holder"] == "rec-a"
    assert "being recovered by 'rec-a'" in held.json()["error"]

    clock.now += 6  # rec-a died: its lease expires
    database_clock_passes(sidecar, 6)
    second = await api(sidecar, "POST", path, json={"holder": "rec-b", "ttl_s": 5})
    assert second.status_code == 200 and second.json()["token"] == 2
    late = await api(sidecar, "POST", path + "/renew", json={"holder": "rec-a", "token": 1})
    assert late.status_code == 409 and late.json()["reason"] == "not_holder"

    # rec-a's compensate span with its old token is refused; rec-b's is kept.
    stale = RunScript(instance="rec-a", run_id=run.run_id)
    stale.compensate(1, "issue_credit", CREDIT[0], CREDIT[1])
    spans = [rejoin(s, run, token=1) for s in stale.spans() if s.name != stale.run.name]
    answer = await post(sidecar, spans)
    assert answer.partial_success.rejected_spans == 1
    assert "token 1" in answer.partial_success.error_message
    assert refused(sidecar, "stale_token") == 1
    assert sidecar.state.view(run.run_id)["stack"] != []  # type: ignore[index]
    fresh = RunScript(instance="rec-b", run_id=run.run_id)
    fresh.compensate(1, "issue_credit", CREDIT[0], CREDIT[1])
    spans = [rejoin(s, run, token=2) for s in fresh.spans() if s.name != fresh.run.name]
    answer = await post(sidecar, spans)
    assert answer.partial_success.rejected_spans == 0
    assert sidecar.state.view(run.run_id)["stack"] == []  # type: ignore[index]

    done = await api(sidecar, "POST", path + "/release", json={"holder": "rec-b", "token": 2})
    assert done.status_code == 200 and done.json()["released"] is True
    sample = sidecar.metrics.registry.get_sample_value
    assert sample(sc.M_SIDECAR_LEASE_REQUESTS, {"action": "grant", "outcome": "held"}) == 1
    assert sample(sc.M_SIDECAR_LEASE_REQUESTS, {"action": "grant", "outcome": "agent_alive"}) == 1


async def test_forced_lease_is_recorded_on_the_run(sidecar: Sidecar, clock: FakeClock) -> None:
    run = open_run(instance="agent-1")
    await post(sidecar, run.spans())
    resp = await api(
        sidecar,
        "POST",
        f"/runs/{sc.run_id_segment(run.run_id)}/lease",
        json={"holder": "ops@host", "force": True, "reason": "agent wedged, ticket 12"},
    )
    assert resp.status_code == 200, resp.text
    view = sidecar.state.view(run.run_id)
    assert view is not None
    assert view["recovery"]["override"] == {"reason": "agent wedged, ticket 12", "by": "ops@host",
                                            "at": clock.now}  # fmt: skip
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(render_run(view))
    assert "FORCED behind a live agent by ops@host" in console.export_text()


async def test_bad_run_ids_are_refused_at_intake_with_the_rule(sidecar: Sidecar) -> None:
    bad_ids = (("tab\there", "U+0009"), ("x" * 257, "at most 256"), ("bidi\u202e", "U+202E"),
               ("..", "dot segment"), (".", "dot segment"))  # fmt: skip
    for bad, why in bad_ids:
        run = open_run(run_id=bad)
        answer = await post(sidecar, run.spans())
        assert answer.partial_success.rejected_spans == len(run.spans())
        assert why in answer.partial_success.error_message
        assert bad not in sidecar.state
    assert refused(sidecar, "bad_run_id") == 2 * len(bad_ids)


async def test_odd_ids_are_one_path_segment_in_the_api(sidecar: Sidecar) -> None:
    for odd in ("x/../victim", "a/b?c#d", "50%", "sp ace", "日本", "...", "%2E%2E"):
        run = open_run(run_id=odd)
        await post(sidecar, run.spans())
        got = await api(sidecar, "GET", f"/runs/{sc.run_id_segment(odd)}")
        assert got.status_code == 200 and got.json()["run_id"] == odd
        stack = await api(sidecar, "GET", f"/runs/{sc.run_id_segment(odd)}/stack")
        assert stack.json()["run_id"] == odd


async def test_an_unstorable_undo_keeps_the_run_from_ending_compensated(sidecar: Sidecar) -> None:
    run = RunScript()
    run.do(0, "issue_credit", "compensable")
    span_attrs = {sc.SAGA_COMPENSATION_UNSTORABLE: "args are not JSON: datetime"}
    spans = [with_attrs(run.spans()[0], **{k.replace(".", "_"): v for k, v in span_attrs.items()})]
    run.do(1, "notify", "compensable", ok=False)
    run.unwind("TimeoutError: x", "notify", [])
    run.end(sc.STATUS_COMPENSATED, "notify")
    await post(sidecar, spans + run.spans()[1:])
    view = sidecar.state.view(run.run_id)
    assert view is not None
    assert view["status"] == sc.STATUS_COMPENSATION_FAILED
    assert view["steps"][0]["compensation_unstorable"] == "args are not JSON: datetime"
    card = view["escalation"]["card"]
    assert view["escalation"]["reason"] == sc.ESCALATION_COMPENSATION_FAILED
    assert any("issue_credit" in t and "datetime" in t for t in card["not_undone"])


async def test_the_decide_line_for_an_unstorable_undo_quotes_the_run_id_for_a_shell(
    sidecar: Sidecar,
) -> None:
    # The run-id rule allows quotes, $ and parentheses; a person pastes this line.
    odd = "r'$(echo INJECTED)"
    run = RunScript(run_id=odd)
    run.do(0, "issue_credit", "compensable")
    attrs = {sc.SAGA_COMPENSATION_UNSTORABLE.replace(".", "_"): "args are not JSON: datetime"}
    spans = [with_attrs(run.spans()[0], **attrs)]
    run.do(1, "notify", "compensable", ok=False)
    run.unwind("TimeoutError: x", "notify", [])
    run.end(sc.STATUS_COMPENSATED, "notify")
    await post(sidecar, spans + run.spans()[1:])
    view = sidecar.state.view(odd)
    assert view is not None and view["escalation"] is not None
    (line,) = [d for d in view["escalation"]["card"]["decide"] if "runs resolve" in d]
    command = re.search(r"`saga-sidecar runs resolve (.*) --note \.\.\.`", line)
    assert command is not None, line
    # What bash hands the command: the run id, unexpanded.
    shell = await asyncio.create_subprocess_exec(
        "bash", "-c", f"printf '%s' {command[1]}", stdout=asyncio.subprocess.PIPE
    )  # fmt: skip
    out, _ = await shell.communicate()
    assert out.decode() == odd, (line, out)


async def test_an_interrupted_write_keeps_the_run_from_ending_compensated(
    sidecar: Sidecar,
) -> None:
    """A do span that failed because its attempt was interrupted (the agent's library says
    so with saga.compensation.unstorable): its write may stand with no undo, so the run,
    though its agent says compensated, ends compensation_failed and escalates. A plain
    failed do (the tool's own error: nothing happened) leaves it compensated."""
    why = "the do of step 'issue_credit' (index 1) was interrupted by KeyboardInterrupt"
    for marked, status in ((True, sc.STATUS_COMPENSATION_FAILED), (False, sc.STATUS_COMPENSATED)):
        run = RunScript()
        run.do(0, "lookup_order", "read")
        run.do(1, "issue_credit", "compensable", ok=False, error="KeyboardInterrupt: ")
        run.unwind("KeyboardInterrupt: ", "issue_credit", [])
        run.end(sc.STATUS_COMPENSATED, "issue_credit")  # its agent claims more than it knows
        spans = run.spans()
        if marked:
            spans[1] = with_attrs(spans[1], saga_compensation_unstorable=why)
        await post(sidecar, spans)
        view = sidecar.state.view(run.run_id)
        assert view is not None and view["status"] == status, view["status"]
        if marked:
            assert view["steps"][1]["compensation_unstorable"] == why
            card = view["escalation"]["card"]
            assert any("issue_credit" in t and "interrupted" in t for t in card["not_undone"])


async def test_an_unstorable_undo_done_in_process_after_all_counts_as_undone(
    sidecar: Sidecar,
) -> None:
    # docs/semantic-conventions.md: an OK compensate span of the same index (an observed()
    # runner undid it in process) lifts the rule.
    run = RunScript()
    run.do(0, "issue_credit", "compensable")
    unstorable = {"saga_compensation_unstorable": "args are not JSON: datetime"}
    spans = [with_attrs(run.spans()[0], **unstorable)]
    run.do(1, "notify", "compensable", ok=False)
    run.unwind("TimeoutError: x", "notify", [])
    run.compensate(0, "issue_credit", CREDIT[0], CREDIT[1])
    run.end(sc.STATUS_COMPENSATED, "notify")
    await post(sidecar, spans + run.spans()[1:])
    view = sidecar.state.view(run.run_id)
    assert view is not None
    assert view["steps"][0]["compensation_unstorable"] is None
    assert view["status"] == sc.STATUS_COMPENSATED and view["escalation"] is None


async def test_a_dropped_span_marker_shows_on_the_run_and_escalates(sidecar: Sidecar) -> None:
    run = compensated_run()
    spans = run.spans()
    marker = with_attrs(spans[1])  # a marker in place of the credit's do span
    marker = ReadableSpan(
        name="saga.export.dropped",
        context=marker.context,
        resource=marker.resource,
        attributes={
            sc.SAGA_RUN_ID: run.run_id,
            sc.SAGA_PHASE: sc.PHASE_DO,
            sc.SAGA_EXPORT_DROPPED: "too_large",
            sc.SAGA_EXPORT_DROPPED_SPAN: "saga.do issue_credit",
        },
        start_time=marker.start_time,
        end_time=marker.end_time,
    )
    await post(sidecar, [s for i, s in enumerate(spans) if i != 1] + [marker])
    view = sidecar.state.view(run.run_id)
    assert view is not None
    assert view["dropped_spans"][0]["span"] == "saga.do issue_credit"
    assert view["status"] == sc.STATUS_COMPENSATION_FAILED
    assert "too_large" in json.dumps(view["escalation"]["card"])


def _open(db: Path, clock: FakeClock) -> Sidecar:
    """A sidecar without listeners on ``db``: intake and state only (fast enough for Hypothesis)."""
    sidecar = Sidecar(settings_for(db.parent, db_path=db), clock=clock)
    sidecar.store = open_store(sidecar.database)
    sidecar._rebuild()
    return sidecar


def _pool() -> list[ReadableSpan]:
    owner = compensated_run(instance="agent-1", run_id="r-1")
    spans = owner.spans()
    conflicting = [
        with_attrs(spans[1], saga_step_index=7),
        with_attrs(spans[4], saga_compensation_args='{"credit_id": "other"}'),
    ]
    stranger = RunScript(instance="intruder", run_id="r-1", t0=1_500_000_000.0)
    stranger.do(0, "wipe", "compensable", comp=("delete_account", {}, "x"))
    return [*spans, *conflicting, *stranger.spans()]


POOL = _pool()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    order=st.permutations(range(len(POOL))),
    cuts=st.lists(st.integers(1, len(POOL) - 1), max_size=4, unique=True),
)
def test_any_interleaving_then_a_restart_gives_the_same_view(
    tmp_path_factory: Any, order: list[int], cuts: list[int]
) -> None:
    db = tmp_path_factory.mktemp("db") / "sidecar.db"
    clock = FakeClock()
    live = _open(db, clock)
    bounds = [0, *sorted(cuts), len(order)]
    for a, b in itertools.pairwise(bounds):
        body = encode_spans([POOL[i] for i in order[a:b]]).SerializeToString()
        asyncio.run(live.ingest(extract(parse_protobuf(body), body), "http"))
    views = {r: live.state.view(r) for r in live.state.run_ids()}
    assert live.store is not None
    live.store.close()
    again = _open(db, clock)
    assert {r: again.state.view(r) for r in again.state.run_ids()} == views
    assert again.store is not None
    again.store.close()


async def test_a_renewal_is_refused_once_the_agent_speaks_again_unless_forced(
    tmp_path: Path, clock: FakeClock
) -> None:
    """An agent paused past the orphan window was not dead: when it speaks about its run
    again (a heartbeat naming it, or a span) the recoverer's next renewal is refused, so
    it stops before its next undo. A restart, which folds the stored spans back in, does
    not make a dead agent look back; a forced recovery is not stopped."""
    settings = settings_for(tmp_path)
    runs: dict[str, tuple[RunScript, int]] = {}
    async with Sidecar(settings, clock=clock) as sidecar:
        for speak in ("heartbeat", "span", "forced", "restart"):
            run = open_run(instance="agent-1")
            await post(sidecar, run.spans())
            clock.now += sidecar.settings.idle_timeout + 1
            database_clock_passes(sidecar, sidecar.settings.idle_timeout + 1)
            sidecar.tick()
            path = f"/runs/{sc.run_id_segment(run.run_id)}/lease"
            ask: dict[str, Any] = {"holder": f"rec-{speak}", "ttl_s": 600}
            if speak == "forced":
                # Forced while the agent is alive: the override is the person's choice.
                await post(sidecar, heartbeat_spans("agent-1", [run.run_id], at=0.0))
                ask.update(force=True, reason="agent wedged, ticket 12")
            grant = await api(sidecar, "POST", path, json=ask)
            assert grant.status_code == 200, grant.text
            runs[speak] = (run, grant.json()["token"])
            clock.now += 1
            database_clock_passes(sidecar, 1)
            renewal = {"holder": f"rec-{speak}", "token": grant.json()["token"], "ttl_s": 600}
            assert (await api(sidecar, "POST", path + "/renew", json=renewal)).status_code == 200
        clock.now += 1
        database_clock_passes(sidecar, 1)
        for speak in ("heartbeat", "forced"):
            await post(sidecar, heartbeat_spans("agent-1", [runs[speak][0].run_id], at=0.0))
        runs["span"][0].do(2, "note_ticket", "read")
        await post(sidecar, runs["span"][0].spans())
        heard = clock.now
        clock.now += 1
        database_clock_passes(sidecar, 1)
        for speak, (run, token) in runs.items():
            path = f"/runs/{sc.run_id_segment(run.run_id)}/lease"
            renewal = {"holder": f"rec-{speak}", "token": token, "ttl_s": 600}
            answer = await api(sidecar, "POST", path + "/renew", json=renewal)
            if speak in ("heartbeat", "span"):
                assert answer.status_code == 409, (speak, answer.text)
                body = answer.json()
                assert body["reason"] == "agent_alive" and body["last_heard"] == heard, body
                assert "goes on with the run" in body["error"], body
                # The refused recoverer still gives its lease back.
                done = await api(sidecar, "POST", path + "/release", json=renewal)
                assert done.status_code == 200, done.text
            else:
                assert answer.status_code == 200, (speak, answer.text)
        sample = sidecar.metrics.registry.get_sample_value
        assert sample(sc.M_SIDECAR_LEASE_REQUESTS, {"action": "renew", "outcome": "agent_alive"})
    clock.now += 1
    database_clock_passes(sidecar, 1)
    async with Sidecar(settings, clock=clock) as again:
        # The restart folded every stored span in at its own clock: the "restart" run's
        # dead agent must not look back, so its recoverer goes on.
        run, token = runs["restart"]
        path = f"/runs/{sc.run_id_segment(run.run_id)}/lease"
        renewal = {"holder": "rec-restart", "token": token, "ttl_s": 600}
        answer = await api(again, "POST", path + "/renew", json=renewal)
        assert answer.status_code == 200, answer.text
