"""The on-call person's pages: a run page at the link every alert carries, and ``/review``.

Server-rendered HTML (Jinja2, autoescaped, templates in ``sidecar/templates``):
no scripts, no build step, nothing fetched from elsewhere, so a page works
offline and on a locked-down laptop at 3 a.m. The JSON API is unchanged: a
``GET /runs/{id}`` that prefers ``text/html`` (a browser following ``run_url``)
gets the page, every other client keeps getting JSON.

Auth is the API's: with ``--token``, a browser sends the token as the password
of HTTP Basic auth (it prompts once per origin), which :func:`browser_auth`
hands to the API's bearer check unchanged. The resolve form is a POST that a
page of another origin cannot forge (Origin / Sec-Fetch-Site are checked),
since a browser's Basic credentials travel with cross-site requests too, and a
request whose Host does not name this sidecar (a page renamed by DNS rebinding,
which passes the Origin check) is refused first (sidecar/_hosts.py).

Nothing on a page is built from the request's Host: its commands name
``--public-url`` or the address the sidecar bound, as its alerts' links do.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import shlex
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Final, NamedTuple
from urllib.parse import parse_qs, quote, urlencode, urlsplit

import jinja2
from aiohttp import web
from aiohttp.typedefs import Middleware
from markupsafe import Markup
from multidict import CIMultiDict
from rich.console import Console

from saga_otel import semconv as sc

from ._alerting import (
    CLEARING_STATUSES,
    RuleConfig,
    build_card,
    counted,
    open_alerts,
    render_card,
)
from ._errors import StoreError
from ._hosts import HostRule
from ._outbox import AlertHistoryRow, alert_history
from ._render import age, printable, render_run
from ._service import BODY, SERVICE, Service
from ._settings import http_url
from ._views import RunView

TEMPLATES: Final = Path(__file__).with_name("templates")
HTML: Final = "text/html"
DIAGRAM_WIDTH: Final = 110
NOTE_MAX: Final = 4000
# A resolution's `by`: a person's name or handle, not a second note (the API's bound too).
BY_MAX: Final = 200
# Runs on one page of /review: the oldest; a link leads to the next ones.
REVIEW_PAGE: Final = 200

# The alert whose card a run page shows when the agent sent none: the most pressing first.
_CARD_PRIORITY: Final = (
    sc.ALERT_RUN_ORPHANED,
    sc.ALERT_COMPENSATION_FAILED,
    sc.ALERT_RUN_STUCK,
    sc.ALERT_COMPENSATION_STARTED,
)
_STATUS_ALERT: Final[Mapping[str, str]] = {
    sc.STATE_ORPHANED: sc.ALERT_RUN_ORPHANED,
    sc.STATUS_COMPENSATION_FAILED: sc.ALERT_COMPENSATION_FAILED,
    sc.STATUS_STUCK: sc.ALERT_RUN_STUCK,
}


def _shown(value: object) -> object:
    """Every ``{{ }}`` of the pages, before escaping: agent text with its control and
    bidi characters shown as escapes, as the CLI shows it (HTML escaping leaves them,
    and a bidi override reorders what a person reads). Markup (the drawing) already is."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return printable(value)
    return value


_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    autoescape=True,  # every template, whatever its name: all of it is user data
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    finalize=_shown,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HistoryEntry(NamedTuple):
    """One alert event of a run and how each sink took it."""

    at: str
    alertname: str
    action: str
    summary: str
    sinks: tuple[str, ...]


# --- helpers shared by both pages ---------------------------------------------------


def wants_html(accept: str) -> bool:
    """True when an Accept header prefers HTML to JSON (a browser, not an API client).

    ``*/*`` alone (curl, httpx, aiohttp) means JSON: the API's answer is unchanged.
    """
    html = json_q = star = 0.0
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        media = media.lower()
        if media in ("text/html", "application/xhtml+xml"):
            html = max(html, q)
        elif media == "application/json":
            json_q = max(json_q, q)
        elif media == "*/*":
            star = max(star, q)
    # JSON's weight is its own q when listed, else what */* gives it; a tie keeps JSON.
    return html > (json_q or star)


def when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_path(run_id: str) -> str:
    return f"/runs/{quote(run_id, safe='')}"


def diagram(view: RunView, now: float) -> Markup:
    """The run as ``saga-sidecar runs show`` draws it, as HTML (rich escapes the text).

    The card and the resolution have their own sections on the page, so they are
    left out of the drawing. Its times are UTC with ages against ``now`` (the service's
    clock), as the rest of the page: the CLI's are local, the server's zone is no one's.
    """
    body = view.copy()
    body["escalation"] = body["resolution"] = None
    console = Console(
        record=True,
        width=DIAGRAM_WIDTH,
        file=io.StringIO(),
        force_terminal=True,
        color_system="truecolor",
    )
    console.print(render_run(body, now=now, tz=UTC))
    return Markup(console.export_html(inline_styles=True, code_format="{code}"))


def card_text(view: RunView, run_url: str) -> str | None:
    """The escalation card as the text alerts carry; None when no person is asked anything.

    The agent's own card wins field by field; the sidecar's (built from the view, as
    alerts build it) fills what the agent left out, e.g. an orphaned run's.
    """
    esc = view["escalation"]
    card = esc["card"] if esc is not None else None
    sent = {str(k): v for k, v in card.items() if v} if isinstance(card, Mapping) else {}
    pressing = open_alerts(view)
    name: str | None = next((a for a in _CARD_PRIORITY if a in pressing), None)
    name = name or _STATUS_ALERT.get(view["status"])
    if name is None and not sent:
        return None
    own = view.copy()
    own["escalation"] = None
    base = build_card(name, own, run_url) if name is not None else {}
    if sent:
        # The agent's card says what will happen; a stuck run's stack will not be undone.
        base.pop("will_undo", None)
    return render_card({**base, **sent})


def recover_command(run_id: str, api: str, otlp: str) -> str:
    """The ``saga-otel recover`` line for this run, safe to paste into a POSIX shell."""
    return shlex.join(["saga-otel", "recover", run_id, "--sidecar", api, "--otlp", otlp])


def history(rows: list[AlertHistoryRow]) -> list[HistoryEntry]:
    """Outbox rows (one per sink) folded into one entry per alert event, oldest first."""
    entries: dict[tuple[str, str], HistoryEntry] = {}
    for row in rows:
        key = (row.alertname, row.action)
        sink = f"{row.sink}: {row.state}"
        if row.state != "delivered" and row.attempts:
            sink += f" after {counted(row.attempts, 'attempt')}"
        if row.last_error and row.state != "delivered":
            sink += f" ({row.last_error})"
        found = entries.get(key)
        if found is None:
            entries[key] = HistoryEntry(
                when(row.created_at), row.alertname, row.action, row.summary, (sink,)
            )
        else:
            entries[key] = found._replace(sinks=(*found.sinks, sink))
    return list(entries.values())


def _origin_ok(request: web.Request) -> bool:
    """A state-changing POST must come from a page of this origin (or from no browser)."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("Origin")
    if origin is None:
        return True  # not sent by a page: the bearer check decides
    return origin != "null" and origin.partition("://")[2] == request.host


def _basic_password(header: str) -> str | None:
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.partition(":")[2]


_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})


def _cross_site_refusal(request: web.Request) -> web.Response:
    why = (
        f"this sidecar refuses a {request.method} sent by another site's page "
        f"(Origin {request.headers.get('Origin')!r}, Sec-Fetch-Site "
        f"{request.headers.get('Sec-Fetch-Site')!r})"
    )
    if wants_html(request.headers.get("Accept", "")):
        return _page(
            "error.html",
            status=403,
            title="Refused: not from this sidecar's page",
            message=f"The resolve form must be sent from this sidecar's own run page: {why}.",
        )
    return web.json_response(
        {"error": f"{why}: call the API from a script or the CLI, not from a web page"},
        status=403,
    )


def misdirected(service: Service) -> Middleware:
    """Outermost API middleware: a request whose Host does not name this sidecar is
    refused with 421 before anything else (the rule, and why: sidecar/_hosts.py)."""
    refusal = HostRule.of(service.settings, service.public_url).refusal

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        why = refusal(request.headers.get("Host"))
        if why is None:
            return await handler(request)
        if wants_html(request.headers.get("Accept", "")):
            return _page(
                "error.html",
                status=421,
                title="Refused: not this sidecar's address",
                message=f"{why}.",
            )
        return web.json_response({"error": why}, status=421)

    return middleware


def browser_auth(service: Service) -> Middleware:
    """Outer API middleware: a browser's Basic credentials become the API's bearer token,
    and a state-changing request from another site's page is refused.

    The origin check covers every POST of the API, JSON routes included: a browser
    sends its Basic credentials (or, on loopback without a token, none are needed) with
    a cross-site form, and a ``text/plain`` form can carry a JSON body. The bearer check
    itself stays the API's (inner) middleware. A 401 to a browser is a small page with
    a Basic challenge, so the browser asks for the token.
    """
    token = service.settings.token

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method not in _SAFE_METHODS and not _origin_ok(request):
            return _cross_site_refusal(request)
        if not token:
            return await handler(request)
        password = _basic_password(request.headers.get("Authorization", ""))
        if password is not None:
            headers = CIMultiDict(request.headers)
            headers["Authorization"] = f"Bearer {password}"
            request = request.clone(headers=headers)
        resp = await handler(request)
        if resp.status == 401 and wants_html(request.headers.get("Accept", "")):
            return _page(
                "error.html",
                status=401,
                headers={"WWW-Authenticate": 'Basic realm="saga-sidecar", charset="UTF-8"'},
                title="The sidecar needs its token",
                message="This sidecar runs with --token. Sign in with any user name and the "
                "token (SAGA_SIDECAR_TOKEN) as the password.",
            )
        return resp

    return middleware


def _page(
    template: str, *, status: int = 200, headers: Mapping[str, str] | None = None, **context: object
) -> web.Response:
    body = _env.get_template(template).render(**context)
    resp = web.Response(text=body, status=status, content_type=HTML, charset="utf-8")
    resp.headers.update(headers or {})
    # Nothing on these pages comes from elsewhere, and nothing runs: say so to the browser.
    resp.headers["Content-Security-Policy"] = (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    )
    resp.headers["X-Content-Type-Options"] = "nosniff"
    # same-origin, not no-referrer: with no-referrer a form POST says Origin: null.
    resp.headers["Referrer-Policy"] = "same-origin"
    resp.headers["Cache-Control"] = "no-store"
    return resp


# --- the pages (handlers of the API app; the service is request.app[SERVICE]) ---------


def page_routes() -> list[web.RouteDef]:
    """The pages' routes, added to the API app by ``_http.build_api_app``."""
    return [
        web.get("/ui/runs/{run_id}", run_page),
        web.post("/ui/runs/{run_id}/resolve", resolve),
        web.get("/review", review),
    ]


def _bases(service: Service) -> tuple[str, str]:
    """The API and OTLP/HTTP base URLs people use: ``--public-url`` (the OTLP port on its
    host), else the bound address, as alerts link. Never the request's Host: a client's
    word, which may name anything, or no port."""
    settings = service.settings
    return _bases_of(
        service.public_url,
        settings.host,
        service.api_port or settings.api_port,
        service.otlp_http_port or settings.otlp_http_port,
    )


@lru_cache(maxsize=8)  # a wildcard bind names the machine: a DNS lookup, once
def _bases_of(public_url: str | None, host: str, api_port: int, otlp_port: int) -> tuple[str, str]:
    if public_url is None:
        return http_url(host, api_port), http_url(host, otlp_port)
    return public_url.rstrip("/"), http_url(urlsplit(public_url).hostname or host, otlp_port)


def _not_found(run_id: str) -> web.Response:
    return _page(
        "error.html",
        status=404,
        title="No such run",
        message=f"No run {run_id!r} is known here. Finished runs are pruned after the "
        "retention period (--retention); the review queue lists the runs that need a person.",
    )


async def run_page(
    request: web.Request, *, note: str = "", by: str = "", problem: str = "", status: int = 200
) -> web.Response:
    service = request.app[SERVICE]
    run_id = request.match_info["run_id"]
    try:
        view = (await service.lookup(run_id)).view(run_id)
    except StoreError as exc:
        return _page(
            "error.html",
            status=503,
            headers={"Retry-After": "1"},
            title="The database did not answer",
            message=f"{exc}. Reload the page in a moment.",
        )
    if view is None:
        return _not_found(run_id)
    redactor = service.redactor
    if redactor.active:
        # A page is for people: the same masks as alerts and the API (no reveal here).
        view = redactor.redact(view, redactor.secrets_in(view))
    api, otlp = _bases(service)
    run_url = RuleConfig(public_url=api).run_url(run_id)
    now = service.clock()
    token = bool(service.settings.token)
    state = view["status"]
    resolution = view["resolution"]
    started = view["started_at"]
    try:
        target = service.database
        rows = (
            alert_history(target, run_id)
            if target.backend == "sqlite"
            else await asyncio.to_thread(alert_history, target, run_id)
        )
        alerts = history(rows)
    except StoreError as exc:
        alerts, problem = [], problem or str(exc)
    auth = '-H "Authorization: Bearer $SAGA_SIDECAR_TOKEN" ' if token else ""
    return _page(
        "run.html",
        status=status,
        view=view,
        state=state,
        started=when(started),
        ended=when(view["ended_at"]),
        updated=when(view["updated_at"]),
        run_age=age(now - started) if started is not None else "-",
        # Off the loop: rich takes ~0.4 ms a step, 0.8 s that every request waited out
        # for a run of 2,000.
        diagram=await asyncio.to_thread(diagram, view, now),
        card=card_text(view, run_url),
        recover=(
            recover_command(run_id, api, otlp)
            if view["stack"] and state not in CLEARING_STATUSES and not resolution
            else None
        ),
        token=token,
        json_cmd=f"curl {auth}{shlex.quote(run_url)}",
        alerts=alerts,
        resolution=resolution,
        resolved_at=when(resolution["at"]) if resolution else "-",
        can_resolve=not resolution and state not in CLEARING_STATUSES,
        action=f"/ui/runs/{quote(run_id, safe='')}/resolve",
        note=note,
        by=by,
        by_max=BY_MAX,
        problem=problem,
        now=when(now),
    )


async def resolve(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    run_id = request.match_info["run_id"]
    # The form's body, read (bounded) by the API's body middleware: _service.BODY.
    form = parse_qs(request.get(BODY, b"").decode("utf-8", "replace"))
    note = form.get("note", [""])[0].strip()
    # The name field may be left empty: then no name is stored (none is made up).
    by = form.get("by", [""])[0].strip()
    problem = ""
    if not note:
        problem = "Say what a person did or decided: the note is empty."
    elif len(note) > NOTE_MAX:
        problem = f"The note is {len(note)} characters: keep it under {NOTE_MAX}."
    elif len(by) > BY_MAX:
        problem = f"Your name is {len(by)} characters: keep it under {BY_MAX}."
    if problem:
        return await run_page(request, note=note, by=by, problem=problem, status=400)
    try:
        current = (await service.lookup(run_id)).view(run_id)
    except StoreError as exc:
        return await run_page(request, note=note, by=by, problem=str(exc), status=503)
    if current is not None and current["resolution"]:
        # Two people on one run: the second sees the first's note, it does not overwrite it.
        return await run_page(
            request, problem="Someone resolved this run while you were writing; your note "
            f"was not saved: {note}", status=409,
        )  # fmt: skip
    try:
        view = await service.resolve(run_id, note, first=True, by=by or None)
    except StoreError as exc:
        return await run_page(request, note=note, by=by, problem=str(exc), status=503)
    if view is None:
        return _not_found(run_id)
    resolution = view["resolution"]
    if resolution is not None and resolution["note"] != note:
        # Resolved by someone else between the check above and ours (a database round trip).
        return await run_page(
            request, problem="Someone resolved this run while you were writing; your note "
            f"was not saved: {note}", status=409,
        )  # fmt: skip
    # Post/redirect/get: a reload shows the page, it does not resolve twice.
    raise web.HTTPSeeOther(run_path(run_id))


def _silent_at(service: Service, run_id: str, status: str) -> str:
    """An orphan failed nowhere: say where its agent went silent, as its alert does."""
    last = service.state.last_step(run_id) if status == sc.STATE_ORPHANED else None
    return "-" if last is None else f"(silent after {last})"


_CURSOR: Final = re.compile(r"inf|[0-9][0-9.e+-]{0,30}")


def review_cursor(started_at: float | None, run_id: str) -> str:
    """The ``after`` of the link to the next page: the last row's start and run id."""
    start = repr(float("inf") if started_at is None else float(started_at))
    return urlencode({"after": f"{start},{run_id}"})


def _after(text: str) -> tuple[float, str]:
    """The key a ``review_cursor`` holds; ValueError for text it did not write."""
    start, _, run_id = text.partition(",")
    if not _CURSOR.fullmatch(start) or sc.run_id_problem(run_id) is not None:
        raise ValueError(text)
    return float(start), run_id


async def review(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    now = service.clock()
    after = request.query.get("after")
    try:
        key = _after(after) if after is not None else None
    except ValueError:
        return _page(
            "error.html",
            status=400,
            title="Not a page of the review queue",
            message=f"after={after!r:.80} is not a place this queue linked to: open /review "
            "for the first page, and follow its link to the next.",
        )
    # Bounded: one pass over the runs in memory, then the page's runs only.
    queue = service.state.needing_person(REVIEW_PAGE, key)
    rows = [
        {
            "href": run_path(r["run_id"]),
            "run_id": r["run_id"],
            "saga": r["saga"],
            "status": r["status"],
            "failed_step": r["failed_step"] or _silent_at(service, r["run_id"], r["status"]),
            "age": age(now - r["started_at"]) if r["started_at"] is not None else "-",
            "started": when(r["started_at"]),
            "stack_depth": r["stack_depth"],
            "service": r["service"] or "-",
        }
        for r in queue.runs
    ]
    last = queue.runs[-1] if queue.runs and queue.more else None
    return _page(
        "review.html",
        rows=rows,
        waiting=queue.waiting,
        more=queue.more,
        paged=key is not None,
        next=f"?{review_cursor(last['started_at'], last['run_id'])}" if last else "",
        now=when(now),
    )
