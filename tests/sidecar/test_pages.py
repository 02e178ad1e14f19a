"""The run page and the review queue over real HTTP: content, escaping, auth, the form, links."""

from __future__ import annotations

import asyncio
import base64
import re
import shlex
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from hypothesis import given, settings
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from sidecar_testkit import (
    BOTH_BACKENDS,
    CREDIT,
    FakeClock,
    RunScript,
    agent_cards,
    compensated_run,
    compensation_failed_run,
    completed_run,
    export_http,
    open_run,
    settings_for,
    steering,
    steering_run,
    stuck_run,
)

from saga_otel import semconv as sc
from sidecar import RunState, Sidecar
from sidecar import _pages as pages
from sidecar._alert_service import AlertService, install_alerting
from sidecar._alert_settings import AlertSettings
from sidecar._otlp import extract
from sidecar._pages import wants_html

pytestmark = BOTH_BACKENDS

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.fixture
async def alerting_sidecar(
    tmp_path: Path, clock: FakeClock
) -> AsyncIterator[tuple[Sidecar, AlertService]]:
    sidecar = Sidecar(settings_for(tmp_path, idle_timeout=30.0), clock=clock)
    service = install_alerting(sidecar, AlertSettings(log_sink=True))
    async with sidecar:
        yield sidecar, service


def api(sidecar: Sidecar) -> str:
    return f"http://127.0.0.1:{sidecar.api_port}"


async def get(
    url: str, accept: str = BROWSER, headers: dict[str, str] | None = None
) -> tuple[int, str, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(url, headers={"Accept": accept, **(headers or {})}, allow_redirects=False) as r,
    ):
        return r.status, await r.text(), r.headers


async def post_form(
    url: str, note: str, headers: dict[str, str] | None = None, by: str | None = None
) -> tuple[int, str, Any]:
    data = {"note": note} if by is None else {"note": note, "by": by}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url, data=data, headers={"Accept": BROWSER, **(headers or {})},
            allow_redirects=False,
        ) as r,
    ):  # fmt: skip
        return r.status, await r.text(), r.headers


def visible(html: str) -> str:
    """The page's text roughly as a person reads it (tags dropped, entities decoded)."""
    import html as html_mod

    return html_mod.unescape(re.sub(r"<[^>]+>", "", html))


@pytest.mark.parametrize(
    ("accept", "html"),
    [
        (BROWSER, True),
        ("text/html", True),
        ("*/*", False),
        ("", False),
        ("application/json", False),
        ("application/json, text/html;q=0.5", False),
        ("text/html;q=0.5, application/json", False),
        ("text/html;q=0", False),
        ("text/html, application/json", False),  # equal: clients keep JSON
    ],
)
def test_only_a_client_that_prefers_html_gets_html(accept: str, html: bool) -> None:
    assert wants_html(accept) is html


async def test_the_run_url_opens_the_page_in_a_browser_and_json_for_clients(
    alerting_sidecar: tuple[Sidecar, AlertService],
) -> None:
    sidecar, _ = alerting_sidecar
    run = compensation_failed_run()
    await export_http(sidecar, run.spans())
    status, body, headers = await get(f"{api(sidecar)}/runs/{run.run_id}", accept="*/*")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert '"run_id"' in body
    status, page, headers = await get(f"{api(sidecar)}/runs/{run.run_id}")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    text = visible(page)
    # The drawing of `runs show`: forward steps with class, the unwind with marks, what is left.
    assert "#3 notify_billing (compensable)" in text
    assert "UNWIND (reverse order)" in text
    assert re.search(r"✓ #2 update_ticket  1 attempt\s+restore_ticket\(", text), text
    assert re.search(r"✗ #1 issue_credit  2 attempts\s+reverse_credit\(", text), text
    assert "LEFT ON THE STACK" in text
    # The card as text, not JSON.
    assert "needs a person: compensation_failed" in text
    assert "Could NOT be undone:" in text and "reverse the credit cr_1" in text
    assert '"not_undone"' not in text
    # Its alerts so far, and a way out.
    assert "SagaCompensationFailed" in text and "fire" in text
    assert 'action="/ui/runs/' in page and 'name="note"' in page
    assert "<script" not in page.lower()
    # The same page under /ui, whatever the Accept header.
    status, again, _ = await get(f"{api(sidecar)}/ui/runs/{run.run_id}", accept="*/*")
    assert status == 200 and "needs a person: compensation_failed" in visible(again)


async def test_unknown_run_is_a_404_page_for_people_and_json_for_clients(
    alerting_sidecar: tuple[Sidecar, AlertService],
) -> None:
    sidecar, _ = alerting_sidecar
    status, page, headers = await get(f"{api(sidecar)}/runs/nope")
    assert status == 404 and headers["Content-Type"].startswith("text/html")
    assert "No run 'nope' is known here" in visible(page)
    status, body, headers = await get(f"{api(sidecar)}/runs/nope", accept="*/*")
    assert status == 404 and "error" in body and headers["Content-Type"].startswith("application")


async def test_the_recover_command_is_exact_and_shell_quoted(
    alerting_sidecar: tuple[Sidecar, AlertService], clock: FakeClock
) -> None:
    sidecar, _ = alerting_sidecar
    run_id = "r'1; touch pwned $(id) `x`"
    await export_http(sidecar, open_run(run_id=run_id).spans())
    clock.now += 31
    sidecar.tick()
    status, page, _ = await get(f"{api(sidecar)}/runs/{quote(run_id, safe='')}")
    assert status == 200
    (line,) = re.findall(r'<pre class="wrap" id="recover">(.*?)</pre>', page, re.S)
    import html

    argv = shlex.split(html.unescape(line))
    assert argv == [
        "saga-otel", "recover", run_id,
        "--sidecar", api(sidecar),
        "--otlp", f"http://127.0.0.1:{sidecar.otlp_http_port}",
    ]  # fmt: skip
    assert "SAGA_OTEL_TOOLS" in visible(page)
    assert "needs a person: orphaned" in visible(page)


async def test_resolve_form_resolves_the_run_and_its_alerts(
    alerting_sidecar: tuple[Sidecar, AlertService],
) -> None:
    sidecar, service = alerting_sidecar
    run = stuck_run()
    await export_http(sidecar, run.spans())
    url = f"{api(sidecar)}/ui/runs/{run.run_id}/resolve"
    # An empty note is refused with the page and the reason; nothing is resolved.
    status, page, _ = await post_form(url, "   ")
    assert status == 400 and "the note is empty" in visible(page)
    assert sidecar.state.view(run.run_id)["resolution"] is None  # type: ignore[index]
    status, _, headers = await post_form(
        url, "closed the ticket by hand", headers={"Origin": api(sidecar)}
    )
    assert status == 303 and headers["Location"] == f"/runs/{run.run_id}"
    view = sidecar.state.view(run.run_id)
    assert view is not None and view["resolution"]["note"] == "closed the ticket by hand"
    await service.outbox.flush()  # PostgreSQL: alerts are written on the outbox's thread
    actions = {(r.event.alertname, r.action) for r in service.outbox.rows()}
    assert (sc.ALERT_RUN_STUCK, "resolve") in actions
    status, page, _ = await get(f"{api(sidecar)}/runs/{run.run_id}")
    text = visible(page)
    assert "Resolved " in text and "closed the ticket by hand" in text
    assert "resolve" in text and 'id="resolve"' not in page  # the form is gone


async def test_the_resolve_form_keeps_who_resolved_it_and_the_page_shows_it(
    alerting_sidecar: tuple[Sidecar, AlertService],
) -> None:
    """The form's "your name" field is sent as by: a name past 200 characters is
    refused with the page (what was typed kept), an empty one stores none, and the
    page shows the name with its control and bidi characters as escapes; the run's
    alerts resolve saying who."""
    sidecar, service = alerting_sidecar
    named, nameless = stuck_run(run_id="run-named"), stuck_run(run_id="run-nameless")
    await export_http(sidecar, named.spans() + nameless.spans())
    url = f"{api(sidecar)}/ui/runs/run-named/resolve"
    status, page, _ = await post_form(url, "done by hand", by="n" * 201)
    assert status == 400 and "Your name is 201 characters" in visible(page)
    assert 'value="' + "n" * 201 + '"' in page and "done by hand" in page
    assert sidecar.state.view("run-named")["resolution"] is None  # type: ignore[index]
    assert 'name="by"' in page and 'maxlength="200"' in page
    hostile = "  Eve\x1b]0;pwned\x07\u202e<b>x</b>  "
    status, _, _ = await post_form(url, "done by hand", by=hostile)
    assert status == 303
    view = sidecar.state.view("run-named")
    assert view is not None and view["resolution"] is not None
    assert view["resolution"]["by"] == hostile.strip()
    await service.outbox.flush()  # PostgreSQL: alerts are written on the outbox's thread
    resolves = [r for r in service.outbox.rows() if r.action == "resolve"]
    assert resolves and all(
        f"resolved by a person ({hostile.strip()}): done by hand"
        in r.event.annotations["resolution"]
        for r in resolves
    )
    status, page, _ = await get(f"{api(sidecar)}/runs/run-named")
    assert status == 200 and steering(page) == [] and "<b>" not in page
    banner = re.search(r'<p class="banner ok" id="resolution">(.*?)</p>', page, re.S)
    assert banner, page
    assert visible(banner[1]).endswith(" by Eve\\x1b]0;pwned\\x07\\u202e<b>x</b>: done by hand")
    status, _, _ = await post_form(f"{api(sidecar)}/ui/runs/run-nameless/resolve", "ok", by="")
    assert status == 303
    assert sidecar.state.view("run-nameless")["resolution"]["by"] is None  # type: ignore[index]
    status, page, _ = await get(f"{api(sidecar)}/runs/run-nameless")
    assert 'id="resolved-by"' not in page and ": ok" in visible(page)


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site", "Origin": "http://127.0.0.1:1"},
    ],
)
async def test_a_form_posted_from_another_site_is_refused(
    alerting_sidecar: tuple[Sidecar, AlertService], headers: dict[str, str]
) -> None:
    sidecar, _ = alerting_sidecar
    run = stuck_run()
    await export_http(sidecar, run.spans())
    status, page, _ = await post_form(
        f"{api(sidecar)}/ui/runs/{run.run_id}/resolve", "forged", headers=headers
    )
    assert status == 403 and "Refused" in visible(page)
    assert sidecar.state.view(run.run_id)["resolution"] is None  # type: ignore[index]


async def test_review_lists_runs_needing_a_person_oldest_first(
    alerting_sidecar: tuple[Sidecar, AlertService], clock: FakeClock
) -> None:
    sidecar, _ = alerting_sidecar
    t0 = 1_700_000_000.0
    failed = compensation_failed_run(saga="billing", t0=t0 + 20)
    stuck = stuck_run(saga="refund", t0=t0 + 10)
    orphan = open_run(saga="onboard", t0=t0 - 3600)
    done = compensated_run(t0=t0 - 7200)
    ok = completed_run(t0=t0 - 7300)
    for r in (failed, stuck, orphan, done, ok):
        await export_http(sidecar, r.spans())
    clock.now += 31
    sidecar.tick()
    status, page, _ = await get(f"{api(sidecar)}/review")
    assert status == 200
    order = [m for m in re.findall(r'href="/runs/([0-9a-f]{32})"', page)]
    assert order == [orphan.run_id, stuck.run_id, failed.run_id]
    text = visible(page)
    assert "onboard" in text and "orphaned" in text and "1h 2m" in text  # age of the orphan
    assert "close_ticket" in text and "notify_billing" in text  # failed steps
    # Resolving takes a run off the queue.
    await sidecar.resolve(stuck.run_id, "settled")
    _, page, _ = await get(f"{api(sidecar)}/review")
    assert stuck.run_id not in page and orphan.run_id in page


REVIEW_PAGE = 200  # runs on a page of /review (docs/sidecar.md)


def queue(page: str) -> list[str]:
    """The run ids of the review queue's rows, in order."""
    import html

    return [html.unescape(m) for m in re.findall(r'<a href="/runs/[^"]*">([^<]*)</a>', page)]


def next_link(page: str) -> str | None:
    import html

    found = re.search(r'<a id="next" href="([^"]*)"', page)
    return html.unescape(found[1]) if found else None


async def test_review_shows_the_oldest_page_and_links_the_rest(
    alerting_sidecar: tuple[Sidecar, AlertService],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """30,000 orphans made a 9.8 MB page, rendered on the loop (every request waited ~2 s,
    every minute of every open tab). The queue is one page of the oldest, the rest behind
    a link; its work is for the page's runs (a summary each, no whole view), not all."""
    sidecar, _ = alerting_sidecar
    n = REVIEW_PAGE + 5
    t0 = 1_699_990_000.0
    # Pairs share a start, one pair across the page's end: the order is (start, run id).
    starts = {f"run-{n - i:04d}": (i + 1) // 2 for i in range(n)}
    runs = [open_run(saga="onboard", t0=t0 + start, run_id=run_id)
            for run_id, start in starts.items()]  # fmt: skip
    await export_http(sidecar, [s for r in runs for s in r.spans()])
    clock.now += 31
    sidecar.tick()
    oldest = sorted(starts, key=lambda run_id: (starts[run_id], run_id))
    from sidecar._state import RunState

    built: list[str] = []
    summary, view = RunState._summary, RunState.view

    def count_summary(self: RunState, run: Any) -> Any:
        built.append("summary")
        return summary(self, run)

    def count_view(self: RunState, run_id: str) -> Any:
        built.append("view")
        return view(self, run_id)

    monkeypatch.setattr(RunState, "_summary", count_summary)
    monkeypatch.setattr(RunState, "view", count_view)
    status, page, _ = await get(f"{api(sidecar)}/review")
    assert status == 200
    assert built.count("summary") <= REVIEW_PAGE and "view" not in built
    monkeypatch.undo()
    assert queue(page) == oldest[:REVIEW_PAGE]
    text = visible(page)
    assert f"Review queue ({n})" in text
    assert f"the {REVIEW_PAGE} oldest of {n}" in text and "5 more" in text
    assert "(silent after " in text
    assert "saga-sidecar runs list --needs-person" in text  # the whole list, elsewhere
    link = next_link(page)
    assert link is not None and link.startswith("?after=")
    status, rest, _ = await get(f"{api(sidecar)}/review{link}")
    assert status == 200
    assert queue(rest) == oldest[REVIEW_PAGE:]
    assert next_link(rest) is None and '<a id="first" href="/review">' in rest
    # The cursor holds where the page ended: runs resolved meanwhile do not shift it.
    for run_id in oldest[:10]:
        await sidecar.resolve(run_id, "settled")
    status, again, _ = await get(f"{api(sidecar)}/review{link}")
    assert queue(again) == oldest[REVIEW_PAGE:]
    assert f"Review queue ({n - 10})" in visible(again)


@pytest.mark.parametrize(
    "after",
    ["garbage", "nan,run-1", "-inf,run-1", "1,", ",run-1", "1,..", "1,a\x00b",
     "1," + "x" * 300, "1e999e,r", "٣,run-1"],
)  # fmt: skip
async def test_a_review_cursor_it_did_not_give_out_is_a_400_that_says_what_to_do(
    alerting_sidecar: tuple[Sidecar, AlertService], after: str
) -> None:
    sidecar, _ = alerting_sidecar
    status, page, _ = await get(f"{api(sidecar)}/review?after={quote(after, safe='')}")
    assert status == 400, page[:300]
    assert "open /review for the first page" in visible(page)


def commands(page: str) -> tuple[list[str], list[str]]:
    """The page's recover command and its curl command, as argv."""
    import html

    (recover,) = re.findall(r'<pre class="wrap" id="recover">(.*?)</pre>', page, re.S)
    (curl,) = re.findall(r"The same run as JSON: <code>(.*?)</code>", page, re.S)
    return shlex.split(html.unescape(recover)), shlex.split(html.unescape(curl))


async def test_the_pages_commands_name_the_bound_address_not_the_host_header(
    alerting_sidecar: tuple[Sidecar, AlertService], clock: FakeClock
) -> None:
    """The request's Host is the client's word (a Host without a port dropped the API
    port from both commands): they name the address the sidecar bound, as alerts do."""
    sidecar, _ = alerting_sidecar
    run = open_run()
    await export_http(sidecar, run.spans())
    clock.now += 31
    sidecar.tick()
    bound, otlp = api(sidecar), f"http://127.0.0.1:{sidecar.otlp_http_port}"
    for host in ("localhost", "127.0.0.1", f"[::1]:{sidecar.api_port}", "localhost:9999"):
        status, page, _ = await get(f"{bound}/runs/{run.run_id}", headers={"Host": host})
        assert status == 200, host
        recover, curl = commands(page)
        assert recover == ["saga-otel", "recover", run.run_id, "--sidecar", bound, "--otlp", otlp]
        assert curl == ["curl", f"{bound}/runs/{run.run_id}"], host


async def test_the_pages_commands_name_the_public_url(tmp_path: Path, clock: FakeClock) -> None:
    sidecar = Sidecar(settings_for(tmp_path, idle_timeout=30.0), clock=clock)
    public = "https://saga.example.org/sidecar"
    install_alerting(sidecar, AlertSettings(log_sink=False, public_url=public))
    async with sidecar:
        run = open_run()
        await export_http(sidecar, run.spans())
        clock.now += 31
        sidecar.tick()
        status, page, _ = await get(f"{api(sidecar)}/runs/{run.run_id}")
        assert status == 200
        recover, curl = commands(page)
        assert recover == [
            "saga-otel", "recover", run.run_id, "--sidecar", public,
            "--otlp", f"http://saga.example.org:{sidecar.otlp_http_port}",
        ]  # fmt: skip
        assert curl == ["curl", f"{public}/runs/{run.run_id}"]


HOSTILE = "<script>alert('{}')</script><img src=x onerror=alert(1)>"


async def test_every_user_controlled_field_is_escaped(
    alerting_sidecar: tuple[Sidecar, AlertService], clock: FakeClock
) -> None:
    sidecar, _ = alerting_sidecar

    def h(field: str) -> str:
        return HOSTILE.format(field)

    # A run id cannot hold '/' (it is one path segment): the same tags without it.
    run_id = "<script>alert(1)<img src=x onerror=alert(2)>"
    run = RunScript(saga=h("saga"), run_id=run_id, service=h("service"), instance=h("instance"))
    comp = (h("tool"), {h("argname"): h("argvalue")}, h("description"))
    run.do(0, h("step0"), "compensable", comp=comp)
    run.do(1, h("step1"), "compensable", comp=CREDIT)
    run.do(2, h("step2"), "irreversible", ok=False, error=f"Boom: {h('error')}")
    stack = [{"step": h("step0"), "index": 0, "tool": comp[0], "args": comp[1],
              "description": comp[2]}]  # fmt: skip
    run.unwind(h("reason"), h("step2"), stack)
    run.compensate(1, h("step1"), CREDIT[0], CREDIT[1])
    run.compensate(0, h("step0"), comp[0], comp[1], ok=False, error=f"X: {h('comperror')}")
    run.escalate(sc.ESCALATION_COMPENSATION_FAILED, {"saga": h("card"), "decide": [h("decide")]})
    run.end(sc.STATUS_COMPENSATION_FAILED, h("step2"))
    await export_http(sidecar, run.spans())
    page_url = f"{api(sidecar)}/runs/{quote(run_id, safe='')}"
    status, _, _ = await post_form(
        f"{api(sidecar)}/ui/runs/{quote(run_id, safe='')}/resolve", h("note"), by=h("by")
    )
    assert status == 303
    status, page, _ = await get(page_url)
    assert status == 200
    # A resolved run leaves the queue: show the queue with a second, unresolved copy.
    second = RunScript(saga=h("saga2"), run_id=run_id + "2")
    second.do(0, h("qstep"), "compensable", ok=False)
    second.end(sc.STATUS_COMPENSATION_FAILED, h("qstep"))
    await export_http(sidecar, second.spans())
    status, queue, _ = await get(f"{api(sidecar)}/review")
    assert status == 200
    for served in (page, queue):
        lowered = served.lower()
        assert "<script" not in lowered and "<img" not in lowered
    shown = visible(page)
    for field in ("saga", "step0", "step1", "step2", "tool", "argname", "argvalue",
                  "description", "reason", "error", "comperror", "decide", "note",
                  "by"):  # fmt: skip
        assert f"<script>alert('{field}')</script>" in shown, field
    assert run_id in shown and "onerror=alert(2)" in shown
    assert "<script>alert('saga2')</script>" in visible(queue)
    assert "<script>alert('qstep')</script>" in visible(queue)


def drawn(page: str) -> str:
    """The run diagram of a run page, as text."""
    found = re.search(r'<pre id="diagram">(.*?)</pre>', page, re.S)
    assert found, page
    return visible(found[1])


async def test_the_page_and_the_review_queue_show_controls_and_bidi_as_escapes(
    alerting_sidecar: tuple[Sidecar, AlertService],
) -> None:
    """Outside the drawing too (the title, the facts, the queue's rows): HTML escaping
    leaves control and bidi characters, and a right-to-left override in a saga name
    would reorder what the person acting on the run reads."""
    sidecar, _ = alerting_sidecar
    await export_http(sidecar, steering_run(run_id="run-ctl2").spans())
    for path in ("/runs/run-ctl2", "/review"):
        status, page, _ = await get(f"{api(sidecar)}{path}")
        assert status == 200
        assert steering(page) == [], (path, steering(page))
        assert "refund[bold]\\u202egnp.exe" in visible(page), path


async def test_the_diagram_shows_terminal_controls_as_escapes(
    alerting_sidecar: tuple[Sidecar, AlertService],
) -> None:
    # The drawing is `runs show`'s, exported as HTML: the CLI's rule serves it too.
    sidecar, _ = alerting_sidecar
    await export_http(sidecar, steering_run(run_id="run-ctl").spans())
    status, page, _ = await get(f"{api(sidecar)}/runs/run-ctl")
    assert status == 200
    diagram = drawn(page)
    assert steering(diagram) == [], diagram
    assert "issue_credit\\x1b[2J\\x1b]0;pwned" in diagram
    assert "Boom\\x1b[2K\\x0dfake: all good\\x9b31m" in diagram
    assert "refund[bold]\\u202egnp.exe" in diagram and "reverse\\u2067 it\\x7f" in diagram


@pytest.fixture
def kolkata(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The server's zone is +05:30 for the test."""
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("kolkata")
async def test_the_diagram_is_in_utc_with_ages_by_the_services_clock(
    alerting_sidecar: tuple[Sidecar, AlertService], clock: FakeClock
) -> None:
    sidecar, _ = alerting_sidecar
    run = stuck_run(t0=clock.now - 100)
    await export_http(sidecar, run.spans())
    status, page, _ = await get(f"{api(sidecar)}/runs/{run.run_id}")
    assert status == 200
    # The page's facts, then the drawing: one zone, one clock.
    assert "2023-11-14T22:13:20Z (1m 40s ago)" in visible(page)
    assert "started 2023-11-14T22:13:20+00:00 (1m 40s ago)" in drawn(page), drawn(page)
    assert "+05:30" not in page


async def test_a_large_runs_diagram_is_drawn_off_the_event_loop(
    alerting_sidecar: tuple[Sidecar, AlertService],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Drawn on the loop, a run of 2,000 steps held every request for most of a second.
    sidecar, _ = alerting_sidecar
    run = RunScript(run_id="big")
    for i in range(300):
        run.do(i, "step", "compensable", comp=("undo", {"ref": f"r{i}"}, f"undo r{i}"))
    run.do(300, "fin", "compensable", ok=False)
    run.end(sc.STATUS_STUCK, "fin")
    await export_http(sidecar, run.spans())
    drawn_on: list[int] = []
    real = pages.render_run

    def spy(*args: Any, **kw: Any) -> Any:
        drawn_on.append(threading.get_ident())
        return real(*args, **kw)

    monkeypatch.setattr(pages, "render_run", spy)
    status, page, _ = await get(f"{api(sidecar)}/runs/big")
    assert status == 200
    assert drawn_on and threading.get_ident() not in drawn_on
    # The same drawing as before, drawn elsewhere.
    view = sidecar.state.view("big")
    assert view is not None
    assert f'<pre id="diagram">{pages.diagram(view, clock.now)}</pre>' in page


def _failed_view() -> Any:
    run = compensation_failed_run()
    state = RunState()
    state.apply(extract(encode_spans(run.spans())).spans, 1_700_000_100.0)
    return state.view(run.run_id)


FAILED_VIEW = _failed_view()


@given(agent_cards)
@settings(max_examples=200, deadline=None)
def test_the_pages_card_is_any_agent_card_merged_with_the_sidecars(card: object) -> None:
    """The page's card (the agent's own over the sidecar's) from a card an agent in any
    language wrote: never a 500 instead of the page."""
    view = {**FAILED_VIEW, "escalation": {"reason": "compensation_failed", "card": card}}
    shown = pages.card_text(view, "http://127.0.0.1:4320/runs/x")
    assert shown is not None and "needs a person" in shown


def _basic(password: str, user: str = "oncall") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


async def test_with_a_token_pages_need_it_as_the_api_does(tmp_path: Path, clock: FakeClock) -> None:
    token = "s3cret-token"
    sidecar = Sidecar(settings_for(tmp_path, token=token), clock=clock)
    service = install_alerting(sidecar, AlertSettings(log_sink=True))
    async with sidecar:
        run = stuck_run()
        await export_http(sidecar, run.spans(), headers={"Authorization": f"Bearer {token}"})
        base = api(sidecar)
        for path in (f"/runs/{run.run_id}", f"/ui/runs/{run.run_id}", "/review"):
            status, page, headers = await get(base + path)
            assert status == 401, path
            assert headers["WWW-Authenticate"].startswith("Basic "), path
            assert run.run_id not in page and "token" in visible(page)
            status, _, _ = await get(base + path, headers=_basic("wrong"))
            assert status == 401
            status, page, _ = await get(base + path, headers=_basic(token))
            assert status == 200 and run.run_id in page, path
            status, _, _ = await get(base + path, headers={"Authorization": f"Bearer {token}"})
            assert status == 200, path
        # JSON clients are answered exactly as before.
        status, body, headers = await get(f"{base}/runs/{run.run_id}", accept="*/*")
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer" and "error" in body
        url = f"{base}/ui/runs/{run.run_id}/resolve"
        status, _, _ = await post_form(url, "no token")
        assert status == 401
        assert sidecar.state.view(run.run_id)["resolution"] is None  # type: ignore[index]
        status, _, _ = await post_form(url, "with token", headers=_basic(token))
        assert status == 303
        assert sidecar.state.view(run.run_id)["resolution"]["note"] == "with token"  # type: ignore[index]
        await service.outbox.flush()
        assert any(r.action == "resolve" for r in service.outbox.rows())


@pytest.mark.parametrize("route", ["resolve", "lease", "lease/release"])
async def test_a_cross_site_page_cannot_post_to_the_json_api(
    tmp_path: Path, clock: FakeClock, route: str
) -> None:
    """A page elsewhere can make the browser send its Basic credentials with a
    ``text/plain`` form whose body is JSON: the API's own POSTs are refused like the
    resolve form; a script (no Origin) and the sidecar's own page still get through."""
    token = "s3cret-token"
    sidecar = Sidecar(settings_for(tmp_path, token=token), clock=clock)
    install_alerting(sidecar, AlertSettings(log_sink=True))
    async with sidecar:
        run = stuck_run()
        await export_http(sidecar, run.spans(), headers={"Authorization": f"Bearer {token}"})
        url = f"{api(sidecar)}/runs/{run.run_id}/{route}"
        body = '{"note": "forged", "holder": "evil", "token": "x"}'
        forged = {
            **_basic(token), "Content-Type": "text/plain", "Origin": "http://evil.example",
            "Sec-Fetch-Site": "cross-site",
        }  # fmt: skip
        async with aiohttp.ClientSession() as s:
            async with s.post(url, data=body, headers=forged) as r:
                assert r.status == 403, await r.text()
                why = (await r.json())["error"]
                assert "another site" in why and "http://evil.example" in why
            view = sidecar.state.view(run.run_id)
            assert view is not None and view["resolution"] is None and view["recovery"] is None
            # The same request from a script, then from the sidecar's own origin, is heard.
            same = {"Origin": f"http://127.0.0.1:{sidecar.api_port}"}
            for extra in ({}, same):
                async with s.post(
                    url, data=body, headers={**_basic(token), "Content-Type": "text/plain", **extra}
                ) as r:
                    assert r.status != 403, (extra, await r.text())


async def _run_urls(service: AlertService, run_id: str) -> set[str]:
    for _ in range(500):
        urls = {
            r.event.annotations["run_url"]
            for r in service.outbox.rows()
            if r.event.run_id == run_id
        }
        if urls:
            return urls
        await asyncio.sleep(0.01)
    raise AssertionError("no alert was written")


async def test_run_url_follows_the_bound_api_port(tmp_path: Path, clock: FakeClock) -> None:
    sidecar = Sidecar(settings_for(tmp_path), clock=clock)
    service = install_alerting(sidecar, AlertSettings(log_sink=True))
    async with sidecar:
        assert sidecar.api_port not in (None, 0, 4320)
        run = stuck_run()
        await export_http(sidecar, run.spans())
        urls = await _run_urls(service, run.run_id)
        assert urls == {f"http://127.0.0.1:{sidecar.api_port}/runs/{run.run_id}"}
        status, page, _ = await get(next(iter(urls)))
        assert status == 200 and "needs a person: stuck" in visible(page)


async def test_public_url_wins_over_the_bound_address(tmp_path: Path, clock: FakeClock) -> None:
    sidecar = Sidecar(settings_for(tmp_path), clock=clock)
    settings = AlertSettings(log_sink=True, public_url="https://saga.example.org/sidecar")
    service = install_alerting(sidecar, settings)
    async with sidecar:
        run = stuck_run()
        await export_http(sidecar, run.spans())
        assert await _run_urls(service, run.run_id) == {
            f"https://saga.example.org/sidecar/runs/{run.run_id}"
        }


def test_links_name_the_bound_address() -> None:
    import socket

    from sidecar._settings import http_url

    assert http_url("127.0.0.1", 4999) == "http://127.0.0.1:4999"
    assert http_url("::1", 4320) == "http://[::1]:4320"
    assert http_url("localhost", 1) == "http://localhost:1"
    # A wildcard bind is not an address anyone can open: name the machine.
    assert http_url("0.0.0.0", 4320) == f"http://{socket.getfqdn()}:4320"


async def test_the_pages_fetch_nothing_from_elsewhere(
    alerting_sidecar: tuple[Sidecar, AlertService],
) -> None:
    sidecar, _ = alerting_sidecar
    run = stuck_run()
    await export_http(sidecar, run.spans())
    for path in (f"/runs/{run.run_id}", "/review", "/runs/unknown"):
        _, page, headers = await get(api(sidecar) + path)
        lowered = page.lower()
        assert "<link" not in lowered and " src=" not in lowered and "@import" not in lowered
        assert "url(" not in lowered and "<script" not in lowered
        assert "default-src 'none'" in headers["Content-Security-Policy"]


async def test_two_people_resolving_at_once_keep_the_first_note(
    alerting_sidecar: tuple[Sidecar, AlertService],
) -> None:
    sidecar, _ = alerting_sidecar
    run = stuck_run()
    await export_http(sidecar, run.spans())
    url = f"{api(sidecar)}/ui/runs/{run.run_id}/resolve"
    answers = await asyncio.gather(post_form(url, "first: shipped"), post_form(url, "second"))
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [303, 409]
    view = sidecar.state.view(run.run_id)
    assert view is not None
    kept = view["resolution"]["note"]
    loser = next(page for status, page, _ in answers if status == 409)
    assert "your note was not saved" in visible(loser) and kept in visible(loser)


async def test_a_note_over_the_bound_is_refused(
    alerting_sidecar: tuple[Sidecar, AlertService],
) -> None:
    sidecar, _ = alerting_sidecar
    run = stuck_run()
    await export_http(sidecar, run.spans())
    url = f"{api(sidecar)}/ui/runs/{run.run_id}/resolve"
    status, page, _ = await post_form(url, "x" * 4001)
    assert status == 400 and "keep it under 4000" in visible(page)
    status, page, _ = await post_form(url, "y" * 70_000)  # over the API's body bound
    assert status == 413 and "too long" in visible(page)
    assert sidecar.state.view(run.run_id)["resolution"] is None  # type: ignore[index]
