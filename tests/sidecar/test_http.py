"""OTLP/HTTP intake and the JSON API, driven by the plain OpenTelemetry SDK exporter."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import logging
import random
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export import SpanExportResult
from sidecar_testkit import (
    BOTH_BACKENDS,
    CREDIT,
    TICKET,
    compensated_run,
    compensation_failed_run,
    completed_run,
    export_http,
    open_run,
    stuck_run,
)

from saga_otel import semconv as sc
from sidecar import Sidecar

pytestmark = BOTH_BACKENDS


def api(sidecar: Sidecar, path: str) -> str:
    return f"http://127.0.0.1:{sidecar.api_port}{path}"


def otlp(sidecar: Sidecar) -> str:
    return f"http://127.0.0.1:{sidecar.otlp_http_port}/v1/traces"


async def get_json(sidecar: Sidecar, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(api(sidecar, path)) as resp:
        return resp.status, await resp.json()


def comp(step: str, index: int, c: tuple[str, dict[str, Any], str]) -> dict[str, Any]:
    return {"step": step, "index": index, "tool": c[0], "args": c[1], "description": c[2]}


async def test_completed_run_over_http(sidecar: Sidecar) -> None:
    run = completed_run()
    assert await export_http(sidecar, run.spans()) is SpanExportResult.SUCCESS
    status, view = await get_json(sidecar, f"/runs/{run.run_id}")
    assert status == 200
    assert view["status"] == sc.STATUS_COMPLETED
    assert view["saga"] == "refund"
    assert view["service"] == "refund-agent"
    assert view["instance"] == "agent-1"
    assert view["pivot"] == {"step": "send_reply", "index": 3}
    assert [s["name"] for s in view["steps"]] == [
        "lookup_order",
        "issue_credit",
        "update_ticket",
        "send_reply",
    ]
    assert view["stack"] == [comp("update_ticket", 2, TICKET), comp("issue_credit", 1, CREDIT)]
    assert view["ended_at"] is not None


async def test_compensated_run_stack_is_empty(sidecar: Sidecar) -> None:
    run = compensated_run()
    await export_http(sidecar, run.spans())
    status, body = await get_json(sidecar, f"/runs/{run.run_id}/stack")
    assert status == 200
    assert body == {"run_id": run.run_id, "status": sc.STATUS_COMPENSATED, "stack": []}
    _, view = await get_json(sidecar, f"/runs/{run.run_id}")
    assert view["failed_step"] == "notify_billing"
    assert view["unwind_reason"] == "TimeoutError: upstream timed out"
    assert view["unwind_started_at"] is not None
    assert all(s["compensated"] for s in view["steps"] if s["compensation"])


async def test_compensation_failed_run_keeps_the_failed_item(sidecar: Sidecar) -> None:
    run = compensation_failed_run()
    await export_http(sidecar, run.spans())
    _, view = await get_json(sidecar, f"/runs/{run.run_id}")
    assert view["status"] == sc.STATUS_COMPENSATION_FAILED
    assert view["stack"] == [comp("issue_credit", 1, CREDIT)]
    credit = next(s for s in view["steps"] if s["index"] == 1)
    assert credit["compensation_failed"] is True
    assert [a["ok"] for a in credit["compensations"]] == [False, False]
    assert credit["compensations"][0]["error"] == "HTTPError: 500 from billing"
    assert view["escalation"]["reason"] == "compensation_failed"
    assert view["escalation"]["card"] == {"not_undone": ["reverse the credit cr_1"]}


async def test_stuck_run_and_needs_person_filter(sidecar: Sidecar) -> None:
    stuck, done = stuck_run(), completed_run()
    await export_http(sidecar, stuck.spans() + done.spans())
    _, view = await get_json(sidecar, f"/runs/{stuck.run_id}")
    assert view["status"] == sc.STATUS_STUCK
    assert view["pivot"] == {"step": "send_reply", "index": 1}
    assert view["stack"] == [comp("issue_credit", 0, CREDIT)]
    _, page = await get_json(sidecar, "/runs?needs=person")
    assert [r["run_id"] for r in page["runs"]] == [stuck.run_id]
    _, page = await get_json(sidecar, "/runs?status=completed")
    assert [r["run_id"] for r in page["runs"]] == [done.run_id]


async def test_out_of_order_duplicated_split_delivery(sidecar: Sidecar, tmp_path: Path) -> None:
    run = compensation_failed_run()
    spans = run.spans()
    shuffled = spans + spans[:3]
    random.Random(7).shuffle(shuffled)
    for i in range(0, len(shuffled), 4):
        assert await export_http(sidecar, shuffled[i : i + 4]) is SpanExportResult.SUCCESS
    reference = compensation_failed_run(run_id=run.run_id)
    async with Sidecar(
        sidecar.settings.__class__(
            otlp_http_port=0,
            otlp_grpc_port=0,
            api_port=0,
            # In the test's folder: on PostgreSQL, sidecar.db_path is the default path.
            db_path=tmp_path / "other.db",
        ),
        clock=sidecar.clock,
    ) as other:
        await export_http(other, reference.spans())
        _, expected = await get_json(other, f"/runs/{run.run_id}")
    _, view = await get_json(sidecar, f"/runs/{run.run_id}")
    for key in ("status", "stack", "failed_step", "pivot", "escalation"):
        assert view[key] == expected[key]
    assert [(s["index"], len(s["attempts"]), len(s["compensations"])) for s in view["steps"]] == [
        (s["index"], len(s["attempts"]), len(s["compensations"])) for s in expected["steps"]
    ]


async def test_gzip_and_json_bodies(sidecar: Sidecar) -> None:
    from opentelemetry.exporter.otlp.proto.http import Compression

    run = open_run()
    result = await export_http(sidecar, run.spans(), compression=Compression.Gzip)
    assert result is SpanExportResult.SUCCESS
    _, view = await get_json(sidecar, f"/runs/{run.run_id}")
    assert view["status"] == sc.STATE_RUNNING
    assert view["stack"] == [comp("issue_credit", 1, CREDIT)]


def json_request(run_id: str, attrs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        {"key": sc.SERVICE_INSTANCE_ID, "value": {"stringValue": "agent-j"}}
                    ]
                },
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": "0af7651916cd43dd8448eb211c80319c",
                                "spanId": f"{i + 1:016x}",
                                "name": "x",
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000000100000000",
                                "attributes": a,
                                "status": {"code": 1},
                            }
                            for i, a in enumerate(attrs)
                        ]
                    }
                ],
            }
        ]
    }


def attr(key: str, kind: str, value: Any) -> dict[str, Any]:
    return {"key": key, "value": {kind: value}}


async def test_json_partial_success(sidecar: Sidecar) -> None:
    good = [
        attr(sc.SAGA_PHASE, "stringValue", "do"),
        attr(sc.SAGA_RUN_ID, "stringValue", "run-json"),
        attr(sc.SAGA_NAME, "stringValue", "refund"),
        attr(sc.SAGA_STEP_INDEX, "intValue", "0"),
        attr(sc.SAGA_STEP_NAME, "stringValue", "issue_credit"),
        attr(sc.SAGA_COMPENSATION_TOOL, "stringValue", "reverse_credit"),
        attr(sc.SAGA_COMPENSATION_ARGS, "stringValue", '{"credit_id": "cr_9"}'),
    ]
    no_run_id = [attr(sc.SAGA_PHASE, "stringValue", "do"), attr(sc.SAGA_STEP_INDEX, "intValue", 1)]
    wrong_type = [
        attr(sc.SAGA_PHASE, "stringValue", "do"),
        attr(sc.SAGA_RUN_ID, "stringValue", "run-json"),
        attr(sc.SAGA_STEP_INDEX, "stringValue", "two"),
    ]
    plain = [attr("http.method", "stringValue", "GET")]
    body = json_request("run-json", [good, no_run_id, wrong_type, plain])
    async with aiohttp.ClientSession() as s, s.post(otlp(sidecar), json=body) as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        answer = await resp.json()
    partial = answer["partialSuccess"]
    assert partial["rejectedSpans"] == 2
    assert sc.SAGA_RUN_ID in partial["errorMessage"]
    assert sc.SAGA_STEP_INDEX in partial["errorMessage"]
    _, view = await get_json(sidecar, "/runs/run-json/stack")
    assert view["stack"] == [
        {
            "step": "issue_credit",
            "index": 0,
            "tool": "reverse_credit",
            "args": {"credit_id": "cr_9"},
            "description": "",
        }
    ]
    _, metrics_text = await get_text(sidecar, "/metrics")
    assert 'saga_sidecar_spans_received_total{outcome="rejected",transport="http"} 2.0' in (
        metrics_text
    )
    assert 'saga_sidecar_spans_received_total{outcome="ignored",transport="http"} 1.0' in (
        metrics_text
    )


async def get_text(sidecar: Sidecar, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(api(sidecar, path)) as resp:
        return resp.status, await resp.text()


async def test_protobuf_partial_success_response(sidecar: Sidecar) -> None:
    req = ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id = b"\x01" * 16
    span.span_id = b"\x02" * 8
    kv = span.attributes.add()
    kv.key, kv.value.string_value = sc.SAGA_PHASE, "compensate"
    headers = {"Content-Type": "application/x-protobuf"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(otlp(sidecar), data=req.SerializeToString(), headers=headers) as resp,
    ):
        assert resp.status == 200
        answer = ExportTraceServiceResponse.FromString(await resp.read())
    assert answer.partial_success.rejected_spans == 1
    assert sc.SAGA_RUN_ID in answer.partial_success.error_message


async def test_an_array_valued_phase_is_rejected_not_a_server_error(sidecar: Sidecar) -> None:
    req = ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id = b"\x01" * 16, b"\x03" * 8
    kv = span.attributes.add()
    kv.key = sc.SAGA_PHASE
    kv.value.array_value.values.add().string_value = "do"
    headers = {"Content-Type": "application/x-protobuf"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(otlp(sidecar), data=req.SerializeToString(), headers=headers) as resp,
    ):
        assert resp.status == 200
        answer = ExportTraceServiceResponse.FromString(await resp.read())
    assert answer.partial_success.rejected_spans == 1
    assert sc.SAGA_PHASE in answer.partial_success.error_message


async def test_bad_bodies_get_4xx(sidecar: Sidecar) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            otlp(sidecar), data=b"\xff\xff\xff", headers={"Content-Type": "application/x-protobuf"}
        ) as resp:
            assert resp.status == 400
        async with s.post(
            otlp(sidecar), data=b"{not json", headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 400
            assert "JSON" in (await resp.json())["message"]
        async with s.post(otlp(sidecar), data=b"x", headers={"Content-Type": "text/plain"}) as resp:
            assert resp.status == 415
            assert "application/x-protobuf" in (await resp.json())["error"]
        async with s.post(
            otlp(sidecar),
            data=b"not gzip",
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
        ) as resp:
            assert resp.status == 400
        async with s.get(api(sidecar, "/healthz")) as resp:
            assert resp.status == 200


async def test_protobuf_error_bodies_need_no_googleapis_protos(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """googleapis-common-protos is no dependency of saga-otel[sidecar] (the dev
    environment has it through the SDK's exporters): a protobuf request's error answer
    (400, and the 429/503 exporters retry) is a google.rpc.Status all the same. It was
    built with google.rpc, so an install without it answered 500 instead."""
    from google.rpc import status_pb2

    monkeypatch.setitem(sys.modules, "google.rpc", None)  # import google.rpc fails
    monkeypatch.setitem(sys.modules, "google.rpc.status_pb2", None)
    headers = {"Content-Type": "application/x-protobuf"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(otlp(sidecar), data=b"\xff\xff\xff", headers=headers) as resp,
    ):
        assert resp.status == 400
        status = status_pb2.Status.FromString(await resp.read())
    assert status.code == 3 and "protobuf" in status.message


async def test_size_bound_and_gzip_bomb(tmp_path: Any, clock: Any) -> None:
    from sidecar_testkit import settings_for

    async with Sidecar(settings_for(tmp_path, max_body=1024), clock=clock) as sc_:
        url = otlp(sc_)
        headers = {"Content-Type": "application/x-protobuf"}
        async with aiohttp.ClientSession() as s:
            async with s.post(url, data=b"\x00" * 2048, headers=headers) as resp:
                assert resp.status == 413
            bomb = gzip.compress(b"\x00" * 10_000_000)
            assert len(bomb) < 1024 * 20
            async with s.post(
                url,
                data=bomb[:1000] if len(bomb) > 1024 else bomb,
                headers={**headers, "Content-Encoding": "gzip"},
            ) as resp:
                assert resp.status == 413
            async with s.get(api(sc_, "/healthz")) as resp:
                assert resp.status == 200


async def test_readyz_is_503_while_intake_waits_past_ready_stall_and_healthz_stays_200(
    sidecar: Sidecar, clock: Any
) -> None:
    """Readiness (a load balancer's, an orchestrator's probe) says not to send this
    replica more while a request has waited past --ready-stall for its commit; liveness
    (/healthz) stays 200, since a restart would not free the database."""
    stall = sidecar.settings.ready_stall
    assert await get_json(sidecar, "/readyz") == (
        200,
        {
            "status": "ready",
            "reason": None,
            "intake_waiting_s": 0.0,
            "ready_stall_s": stall,
            "fix": None,
        },
    )
    waiting: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    sidecar._unfolded[waiting] = clock.now  # heard now, its COMMIT not done
    try:
        clock.now += stall  # waited exactly the threshold: still ready
        status, body = await get_json(sidecar, "/readyz")
        assert status == 200 and body["status"] == "ready", body
        clock.now += 37.0
        status, body = await get_json(sidecar, "/readyz")
        assert status == 503, body
        assert body["status"] == "stalled" and body["reason"] == "intake_stalled"
        assert body["intake_waiting_s"] == stall + 37.0 and body["ready_stall_s"] == stall
        assert "--ready-stall" in body["fix"] and "another replica" in body["fix"]
        async with aiohttp.ClientSession() as s, s.head(api(sidecar, "/readyz")) as resp:
            assert resp.status == 503
        status, health = await get_json(sidecar, "/healthz")
        assert status == 200, health
        assert health["status"] == "ok" and health["ready"] is False
        assert health["intake_waiting_s"] == stall + 37.0
    finally:
        del sidecar._unfolded[waiting]  # committed and answered
    status, body = await get_json(sidecar, "/readyz")
    assert status == 200 and body["status"] == "ready" and body["intake_waiting_s"] == 0.0
    status, health = await get_json(sidecar, "/healthz")
    assert status == 200 and health["ready"] is True


async def test_every_gzip_member_is_inflated_under_one_bound(tmp_path: Any, clock: Any) -> None:
    """A gzip body of two members (RFC 1952; ``cat a.gz b.gz``) is inflated whole: both
    runs are stored (the first member alone was answered 200, the second run dropped).
    Bytes after the data that are not a member are a 400 naming them, and a bomb split
    into members is still over --max-body (413)."""
    from sidecar_testkit import settings_for

    async with Sidecar(settings_for(tmp_path, max_body=1 << 20), clock=clock) as sc_:
        first, second = completed_run(instance="agent-a"), completed_run(instance="agent-b")
        # Concatenated protobuf messages merge their repeated fields: one request, two runs.
        body = gzip.compress(encode(first.spans())) + gzip.compress(encode(second.spans()))
        headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
        async with aiohttp.ClientSession() as s:
            async with s.post(otlp(sc_), data=body, headers=headers) as resp:
                assert resp.status == 200
            for run in (first, second):
                status, view = await get_json(sc_, f"/runs/{run.run_id}")
                assert (status, view["status"]) == (200, sc.STATUS_COMPLETED)
            junk = gzip.compress(encode(open_run().spans())) + b"junk"
            async with s.post(otlp(sc_), data=junk, headers=headers) as resp:
                assert resp.status == 400
                assert b"not another gzip member" in await resp.read()
            bomb = gzip.compress(b"\x00" * 600_000) * 2  # each member under the bound
            async with s.post(otlp(sc_), data=bomb, headers=headers) as resp:
                assert resp.status == 413


def encode(spans: Any) -> bytes:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return bytes(encode_spans(spans).SerializeToString())


async def test_unknown_run_is_404_with_message(sidecar: Sidecar) -> None:
    status, body = await get_json(sidecar, "/runs/nope")
    assert status == 404
    assert "nope" in body["error"] and "GET /runs" in body["error"]
    status, body = await get_json(sidecar, "/runs/nope/stack")
    assert status == 404
    status, body = await get_json(sidecar, "/nowhere")
    assert status == 404 and "error" in body


async def test_resolve_and_listeners(sidecar: Sidecar) -> None:
    seen: list[tuple[Any, Any, float]] = []
    sidecar.add_listener(lambda before, after, now: seen.append((before, after, now)))
    run = stuck_run()
    await export_http(sidecar, run.spans())
    assert seen and seen[0][0] is None and seen[-1][1]["status"] == sc.STATUS_STUCK
    seen.clear()
    url = api(sidecar, f"/runs/{run.run_id}/resolve")
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json={"note": "closed the ticket by hand"}) as resp:
            assert resp.status == 200
            view = await resp.json()
        async with s.post(url, json={"nope": 1}) as resp:
            assert resp.status == 400
            assert "note" in (await resp.json())["error"]
        async with s.post(api(sidecar, "/runs/unknown/resolve"), json={"note": "x"}) as resp:
            assert resp.status == 404
    # No by in the body: no name is stored, none made up.
    assert view["resolution"] == {
        "note": "closed the ticket by hand",
        "at": sidecar.clock(),
        "by": None,
    }
    assert len(seen) == 1
    before, after, _ = seen[0]
    assert before["resolution"] is None and after["resolution"]["note"].startswith("closed")
    _, page = await get_json(sidecar, "/runs?needs=person")
    assert page["runs"] == []


async def test_a_resolution_is_not_overwritten_by_a_different_note(
    sidecar: Sidecar, clock: Any
) -> None:
    """The page keeps the first person's note; the API replaced it and re-stamped the
    time. Now: the same note again is a 200, unchanged; another note is a 409 with the
    resolution that stands; ``"replace": true`` puts it in its place, knowingly."""
    seen: list[Any] = []
    run = stuck_run()
    await export_http(sidecar, run.spans())
    sidecar.add_listener(lambda before, after, now: seen.append(after["resolution"]))
    url = api(sidecar, f"/runs/{run.run_id}/resolve")
    alice = {"note": "Alice: reversed cr_1 by hand", "at": clock.now, "by": None}
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json={"note": alice["note"]}) as resp:
            assert resp.status == 200
            assert (await resp.json())["resolution"] == alice
        clock.now += 60
        async with s.post(url, json={"note": alice["note"]}) as resp:  # a retry: idempotent
            assert resp.status == 200
            assert (await resp.json())["resolution"] == alice
        async with s.post(url, json={"note": "Bob: nothing to do"}) as resp:
            assert resp.status == 409
            body = await resp.json()
        assert body["resolution"] == alice
        assert "already resolved" in body["error"] and repr(alice["note"]) in body["error"]
        assert '"replace": true' in body["error"] and "--replace" in body["error"]
        async with s.post(url, json={"note": "Bob", "replace": "yes"}) as resp:
            assert resp.status == 400
            assert "replace='yes'" in (await resp.json())["error"]
        assert seen == [alice]
        assert sidecar.state.view(run.run_id)["resolution"] == alice  # type: ignore[index]
        async with s.post(url, json={"note": "Bob: nothing to do", "replace": True}) as resp:
            assert resp.status == 200
            bob = {"note": "Bob: nothing to do", "at": clock.now, "by": None}
            assert (await resp.json())["resolution"] == bob
        clock.now += 60
        async with s.post(url, json={"note": bob["note"], "replace": True}) as resp:
            assert resp.status == 200  # the same note: nothing to replace, not re-stamped
            assert (await resp.json())["resolution"] == bob
    assert seen == [alice, bob]


async def test_the_api_keeps_a_note_made_on_the_page(sidecar: Sidecar) -> None:
    """The audit's case: Alice resolves on the run page, Bob through the API (the CLI)."""
    run = compensation_failed_run()
    await export_http(sidecar, run.spans())
    async with aiohttp.ClientSession() as s:
        form = {"note": "Alice: reversed cr_1 by hand"}
        page = api(sidecar, f"/ui/runs/{run.run_id}/resolve")
        async with s.post(page, data=form, allow_redirects=False) as resp:
            assert resp.status == 303
        url = api(sidecar, f"/runs/{run.run_id}/resolve")
        async with s.post(url, json={"note": "Bob: nothing to do"}) as resp:
            assert resp.status == 409
            assert (await resp.json())["resolution"]["note"] == form["note"]
    assert sidecar.state.view(run.run_id)["resolution"]["note"] == form["note"]  # type: ignore[index]


async def test_resolve_records_who_resolved_it(sidecar: Sidecar, clock: Any) -> None:
    """``by``: the name a person gives, kept with the note (audit trail, the alert's
    resolution). A name that is not a string or longer than 200 characters is a 400 and
    stores nothing; blank or null stores none; a hostile one is kept as sent (JSON
    escapes it; the pages and the CLI show it escaped). The same note with another by
    is the same resolution: 200, its by unchanged; a replacement brings its own by."""
    run = stuck_run()
    await export_http(sidecar, run.spans())
    url = api(sidecar, f"/runs/{run.run_id}/resolve")
    note = "reversed cr_1 by hand"
    async with aiohttp.ClientSession() as s:
        for by, shown in ((42, "by=42"), (["alice"], "by=['alice']"), (True, "by=True")):
            async with s.post(url, json={"note": note, "by": by}) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
                assert shown in error and "not a string" in error and '"by": "your name"' in error
        async with s.post(url, json={"note": note, "by": "x" * 201}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert "201 characters" in error and "200" in error and "x" * 201 not in error
        assert sidecar.state.view(run.run_id)["resolution"] is None  # type: ignore[index]
        async with s.post(url, json={"note": note, "by": "  alice@example.org  "}) as resp:
            assert resp.status == 200
            alice = {"note": note, "at": clock.now, "by": "alice@example.org"}
            assert (await resp.json())["resolution"] == alice
        clock.now += 60
        # Bob retries Alice's note: the same resolution, still hers, not re-stamped.
        async with s.post(url, json={"note": note, "by": "bob"}) as resp:
            assert resp.status == 200
            assert (await resp.json())["resolution"] == alice
        async with s.post(url, json={"note": "Bob: nothing to do", "by": "bob"}) as resp:
            assert resp.status == 409
            body = await resp.json()
        assert body["resolution"] == alice and "by 'alice@example.org'" in body["error"]
        hostile = "Mallory\x1b]0;pwned\x07\u202e<script>x</script>"
        replaced = {"note": "Mallory: done", "replace": True, "by": hostile}
        async with s.post(url, json=replaced) as resp:
            assert resp.status == 200
            assert (await resp.json())["resolution"]["by"] == hostile
        async with s.post(url, json={"note": "Nobody", "replace": True, "by": " "}) as resp:
            assert resp.status == 200
            assert (await resp.json())["resolution"] == {
                "note": "Nobody",
                "at": clock.now,
                "by": None,
            }
        async with s.post(url, json={"note": "x" * 10, "replace": True, "by": "y" * 200}) as resp:
            assert resp.status == 200  # 200 characters: at the bound, kept
            assert (await resp.json())["resolution"]["by"] == "y" * 200
        async with s.post(url, json={"note": "z", "replace": True, "by": None}) as resp:
            assert resp.status == 200
            assert (await resp.json())["resolution"]["by"] is None


async def test_list_filters_and_cursor_pagination(sidecar: Sidecar) -> None:
    runs = [completed_run(t0=1_700_000_000.0 + i * 10) for i in range(5)]
    await export_http(sidecar, [s for r in runs for s in r.spans()])
    seen: list[str] = []
    path = "/runs?limit=2"
    while True:
        status, page = await get_json(sidecar, path)
        assert status == 200
        assert len(page["runs"]) <= 2
        seen += [r["run_id"] for r in page["runs"]]
        if page["next_cursor"] is None:
            break
        path = f"/runs?limit=2&cursor={page['next_cursor']}"
    assert seen == [r.run_id for r in reversed(runs)]
    _, page = await get_json(sidecar, "/runs?since=1700000015&until=2023-11-14T22:13:55Z")
    assert [r["run_id"] for r in page["runs"]] == [runs[3].run_id, runs[2].run_id]
    _, page = await get_json(sidecar, "/runs?saga=other")
    assert page["runs"] == []
    for bad in ("status=nope", "limit=0", "since=yesterday", "cursor=%%%", "needs=robot"):
        status, body = await get_json(sidecar, f"/runs?{bad}")
        assert status == 400, bad
        assert body["error"]


@pytest.mark.parametrize(
    "raw",
    [
        '[NaN, "r1"]',
        '[Infinity, "r1"]',
        '[true, "r1"]',
        '["1700000001.5", "r1"]',
        "[1, 2]",
        '[1700000001.0, ""]',
        '{"1700000001.0": 0, "r1": 0}',
        # Integers past a float's range: math.isfinite() raised OverflowError, a 500.
        "[" + "9" * 400 + ', "r1"]',
        "[-" + "9" * 400 + ', "r1"]',
        '[1e400, "r1"]',
    ],
)
async def test_a_cursor_the_api_never_gave_out_is_a_400(sidecar: Sidecar, raw: str) -> None:
    # Each once answered 200 with no runs, which reads as "nothing more".
    await export_http(sidecar, stuck_run(run_id="r1").spans())
    cursor = base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")
    status, body = await get_json(sidecar, f"/runs?cursor={cursor}")
    assert status == 400, body
    assert "is not one this API gave out" in body["error"]
    assert "pass next_cursor from the previous page unchanged" in body["error"]


@pytest.mark.parametrize("key", ["since", "until"])
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "9" * 400])
async def test_since_and_until_must_be_finite(sidecar: Sidecar, key: str, value: str) -> None:
    # nan compared false with every start, so the filter let every run through (a 200).
    await export_http(sidecar, completed_run().spans())
    status, body = await get_json(sidecar, f"/runs?{key}={value}")
    assert status == 400, body
    assert f"{key}={value!r:.60}" in body["error"], body
    assert "epoch seconds" in body["error"] and "ISO 8601" in body["error"], body


async def test_since_and_until_at_the_ends_of_the_calendar_are_times(sidecar: Sidecar) -> None:
    run = completed_run()
    await export_http(sidecar, run.spans())
    for query in ("since=0001-01-01T00:00:00%2B00:01", "until=9999-12-31T23:59:59-23:59"):
        status, body = await get_json(sidecar, f"/runs?{query}")
        assert status == 200, body
        assert [r["run_id"] for r in body["runs"]] == [run.run_id]


RUNS_PARAMETERS = "status, saga, since, until, needs, id_prefix, limit, cursor, reveal"


async def test_a_query_parameter_a_route_does_not_take_is_a_400_naming_it(
    sidecar: Sidecar,
) -> None:
    """A typo in a filter once listed every run (a 200): ``stauts=stuck`` read as no
    filter at all. Every JSON route names the parameter and the ones it takes."""
    failed, done = compensation_failed_run(), completed_run()
    await export_http(sidecar, failed.spans() + done.spans())
    one = f"/runs/{failed.run_id}"
    for path, bad, takes in [
        ("/runs?stauts=stuck", "stauts", RUNS_PARAMETERS),
        ("/runs?need=person", "need", RUNS_PARAMETERS),
        ("/runs?limt=1", "limt", RUNS_PARAMETERS),
        (f"{one}?revael=args", "revael", "reveal"),
        (f"{one}/stack?status=stuck", "status", "reveal"),
        ("/healthz?verbose=1", "verbose", "takes no query parameters"),
        ("/readyz?verbose=1", "verbose", "takes no query parameters"),
        ("/metrics?name[]=saga_sidecar_runs", "name[]", "takes no query parameters"),
    ]:
        status, body = await get_json(sidecar, path)
        assert status == 400, (path, body)
        assert f"{bad!r}" in body["error"] and takes in body["error"], body
        assert "docs/sidecar.md" in body["error"], body
    async with aiohttp.ClientSession() as s:
        url = api(sidecar, f"{one}/resolve?replace=true")
        async with s.post(url, json={"note": "x"}) as resp:
            assert resp.status == 400
            assert "'replace'" in (await resp.json())["error"]
        async with s.post(api(sidecar, f"{one}/lease?force=1"), json={}) as resp:
            assert resp.status == 400
            assert "'force'" in (await resp.json())["error"]
    assert sidecar.state.view(failed.run_id)["resolution"] is None  # type: ignore[index]


async def test_a_repeated_query_parameter_is_a_400(sidecar: Sidecar) -> None:
    """``status=stuck&status=completed`` once answered the first, silently."""
    await export_http(sidecar, completed_run().spans())
    for path, key in [
        ("/runs?status=stuck&status=completed", "status"),
        ("/runs?limit=1&limit=2", "limit"),
        ("/runs/any?reveal=args&reveal=args", "reveal"),
    ]:
        status, body = await get_json(sidecar, path)
        assert status == 400, (path, body)
        assert f"{key!r} is given 2 times" in body["error"], body


async def test_reveal_takes_only_args(sidecar: Sidecar) -> None:
    run = compensation_failed_run()
    await export_http(sidecar, run.spans())
    for path in ("/runs", f"/runs/{run.run_id}", f"/runs/{run.run_id}/stack"):
        status, body = await get_json(sidecar, f"{path}?reveal=arg")
        assert status == 400, (path, body)
        assert "reveal='arg'" in body["error"] and "reveal=args" in body["error"], body
        status, body = await get_json(sidecar, f"{path}?reveal=args")
        assert status == 200, (path, body)


async def test_a_cache_buster_is_taken_and_pages_take_any_parameter(sidecar: Sidecar) -> None:
    """``_`` (what jQuery and others add to defeat caches) is accepted on every JSON route.
    The pages a person opens from a link ignore parameters (chat tools add utm_...)."""
    run = compensation_failed_run()
    await export_http(sidecar, run.spans())
    for path in (
        "/runs",
        f"/runs/{run.run_id}",
        f"/runs/{run.run_id}/stack",
        "/healthz",
        "/readyz",
    ):
        status, _ = await get_json(sidecar, f"{path}?_=1712345678901")
        assert status == 200, path
    html = {"Accept": "text/html"}
    async with aiohttp.ClientSession() as s:
        async with s.get(api(sidecar, "/metrics?_=1")) as resp:
            assert resp.status == 200
        for path in (f"/runs/{run.run_id}", f"/ui/runs/{run.run_id}", "/review"):
            async with s.get(api(sidecar, f"{path}?utm_source=chat"), headers=html) as resp:
                assert resp.status == 200, path
                assert resp.content_type == "text/html", path


async def test_metrics_endpoint(sidecar: Sidecar) -> None:
    await export_http(sidecar, stuck_run().spans() + compensated_run().spans())
    status, text = await get_text(sidecar, "/metrics")
    assert status == 200
    assert 'saga_sidecar_runs{state="stuck"} 1.0' in text
    assert 'saga_sidecar_runs{state="compensated"} 1.0' in text
    assert "saga_sidecar_orphaned_runs 0.0" in text
    assert (
        'saga_sidecar_request_duration_seconds_count{route="/v1/traces",transport="http"}' in text
    )
    assert "saga_sidecar_forward_dropped_spans_total 0.0" in text
    assert json.dumps("x")


# --- the OTLP port's own routing (aiohttp's low-level server, no router) -----------------


async def _raw(port: int, request: bytes, *, until: bytes = b"") -> bytes:
    """Send ``request`` as is and read the answer (until ``until`` is in it, or EOF)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        got = b""
        while not (until and until in got):
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            if not chunk:
                break
            got += chunk
        return got
    finally:
        writer.close()


async def test_otlp_port_answers_unknown_paths_and_methods_in_json(sidecar: Sidecar) -> None:
    base = f"http://127.0.0.1:{sidecar.otlp_http_port}"
    proto = {"Content-Type": "application/x-protobuf"}
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/trace", data=b"", headers=proto) as resp:
            assert resp.status == 404
            assert (await resp.json()) == {"error": "Not Found: POST /v1/trace"}
        async with s.get(base + "/v1/traces") as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
            assert (await resp.json()) == {"error": "Method Not Allowed: GET /v1/traces"}
        async with s.put(base + "/v1/saga/presence", data=b"x") as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
        # A query string is not part of the path; the route still answers.
        body = ExportTraceServiceRequest().SerializeToString()
        async with s.post(base + "/v1/traces?x=1", data=body, headers=proto) as resp:
            assert resp.status == 200
    _, text = await get_text(sidecar, "/metrics")
    assert 'saga_sidecar_request_duration_seconds_count{route="other",transport="http"} 3.0' in text
    assert (
        'saga_sidecar_request_duration_seconds_count{route="/v1/traces",transport="http"} 1.0'
        in text
    )


async def test_otlp_port_answers_expect_100_continue(sidecar: Sidecar) -> None:
    """curl (and other clients) send ``Expect: 100-continue`` before a larger body: the
    interim answer comes first, the body after it is taken as usual."""
    port = sidecar.otlp_http_port
    assert port is not None
    run = open_run()
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    body = encode_spans(run.spans()).SerializeToString()
    head = (
        b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-protobuf\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        await writer.drain()
        final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert final.startswith(b"HTTP/1.1 200 ")
    finally:
        writer.close()
    assert sidecar.state.status(run.run_id) is not None
    answer = await _raw(
        port,
        b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: teapot\r\nContent-Length: 0\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 417 ") and b"100-continue" in answer


# --- the presence stream (POST /v1/saga/presence) ------------------------------------------


async def _presence(port: int, hello: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/saga/presence HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (len(hello), hello)
    )
    await writer.drain()
    return reader, writer


async def _until(probe: Any) -> None:
    for _ in range(500):
        if probe():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("gave up waiting")


async def test_presence_closed_without_goodbye_is_a_loss_and_with_one_is_not(
    sidecar: Sidecar, clock: Any
) -> None:
    lost: list[str] = []
    real = sidecar.state.presence_lost
    sidecar.state.presence_lost = lambda i, now: (lost.append(i), real(i, now))  # type: ignore[method-assign]
    port = sidecar.otlp_http_port
    assert port is not None
    # Two connections of one instance (a reconnect racing the old one): one closing is
    # no loss while the other stays.
    _, first = await _presence(port, b'{"instance": "agent-x"}\n')
    _, second = await _presence(port, b'{"instance": "agent-x"}\n')
    await _until(lambda: sidecar._presence.get("agent-x") == 2)
    first.transport.abort()  # as the kernel does for a killed process
    await _until(lambda: sidecar._presence.get("agent-x") == 1)
    assert lost == []
    second.transport.abort()
    await _until(lambda: lost == ["agent-x"])
    # A goodbye: a clean shutdown is not a death.
    _, writer = await _presence(port, b'{"instance": "agent-y"}\n')
    await _until(lambda: "agent-y" in sidecar._presence)
    writer.write(b"4\r\nbye\n\r\n0\r\n\r\n")
    await writer.drain()
    await _until(lambda: "agent-y" not in sidecar._presence)
    writer.close()
    assert lost == ["agent-x"]


async def test_presence_hello_must_name_the_instance(sidecar: Sidecar) -> None:
    port = sidecar.otlp_http_port
    assert port is not None
    reader, writer = await _presence(port, b'{"who": 1}\n')
    answer = await reader.read(200)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 400") and sidecar._presence == {}


async def test_a_client_gone_mid_body_is_no_server_error(
    sidecar: Sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent killed while its request body was on the wire: the connection resets
    under the body read. That is a peer going away, not a sidecar fault: no error
    traceback in the log, and the next agent is served as before."""
    port = sidecar.otlp_http_port
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-protobuf\r\nContent-Length: 1000\r\n\r\n" + b"\n" * 10
        )
        await asyncio.sleep(0.05)  # the handler is waiting for the rest of the body
        # SO_LINGER 0: close sends a reset, as the kernel does for a killed process's socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    await asyncio.sleep(0.1)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    run = completed_run()
    assert await export_http(sidecar, run.spans()) is SpanExportResult.SUCCESS


async def test_logs_and_metrics_sent_here_are_refused_naming_the_fix(sidecar: Sidecar) -> None:
    # An SDK given the sidecar as its one OTLP endpoint posts its logs and metrics too:
    # a 404 (exporters never retry it) that says to point them elsewhere or turn them off.
    base = f"http://127.0.0.1:{sidecar.otlp_http_port}"
    async with aiohttp.ClientSession() as s:
        for path, var in (("/v1/logs", "LOGS"), ("/v1/metrics", "METRICS")):
            headers = {"Content-Type": "application/x-protobuf"}
            async with s.post(base + path, data=b"", headers=headers) as resp:
                assert resp.status == 404
                why = (await resp.json())["error"]
            assert f"OTEL_EXPORTER_OTLP_{var}_ENDPOINT" in why, why
            assert f"OTEL_{var}_EXPORTER=none" in why and "/v1/traces" in why, why
        async with s.post(base + "/v1/other", data=b"") as resp:
            assert resp.status == 404 and "Not Found" in (await resp.json())["error"]
