"""`saga-sidecar`: serve, and look at runs through the API."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import os
import shlex
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import click
import httpx
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from saga_otel import semconv as sc

from ._alert_settings import alert_options, settings_from_options
from ._errors import ApiError, SidecarError
from ._log import configure as configure_logging
from ._log import get_logger
from ._render import age, local_time, printable, printable_doc, render_run, when
from ._settings import (
    DEFAULT_API_PORT,
    DEFAULT_FORWARD_QUEUE,
    DEFAULT_HOST,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_RECEIVING,
    DEFAULT_OTLP_GRPC_PORT,
    DEFAULT_OTLP_HTTP_PORT,
    DEFAULT_READY_STALL,
    ENV_PREFIX,
    Settings,
    parse_duration,
    parse_size,
)
from ._storage import parse_db
from ._views import RunView

if TYPE_CHECKING:
    from ._server import Sidecar

DEFAULT_API = f"http://127.0.0.1:{DEFAULT_API_PORT}"
log = get_logger("sidecar")


def _env(name: str) -> str:
    return ENV_PREFIX + name


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(None, "--version", package_name="saga-otel", prog_name="saga-sidecar")
def main() -> None:
    """saga-sidecar: watches saga runs over OTLP and keeps their compensation stacks."""


@main.command()
@click.option(
    "--host",
    default=DEFAULT_HOST,
    show_default=True,
    envvar=_env("HOST"),
    show_envvar=True,
    help="Address to bind; non-loopback needs --token.",
)
@click.option(
    "--otlp-http-port",
    type=int,
    default=DEFAULT_OTLP_HTTP_PORT,
    show_default=True,
    envvar=_env("OTLP_HTTP_PORT"),
    show_envvar=True,
    help="OTLP/HTTP port (0 = any).",
)
@click.option(
    "--otlp-grpc-port",
    type=int,
    default=DEFAULT_OTLP_GRPC_PORT,
    show_default=True,
    envvar=_env("OTLP_GRPC_PORT"),
    show_envvar=True,
    help="OTLP/gRPC port (0 = any).",
)
@click.option(
    "--api-port",
    type=int,
    default=DEFAULT_API_PORT,
    show_default=True,
    envvar=_env("API_PORT"),
    show_envvar=True,
    help="API and /metrics port (0 = any).",
)
@click.option(
    "--db",
    "db",
    default=None,
    envvar=_env("DB"),
    show_envvar=True,
    help="SQLite file (PATH or sqlite:///PATH) or PostgreSQL URL (postgresql://USER@HOST/DB) "
    "[default: $XDG_STATE_HOME/saga-sidecar/sidecar.db].",
)
@click.option(
    "--token",
    default=None,
    envvar=_env("TOKEN"),
    show_envvar=True,
    help="Require 'Authorization: Bearer TOKEN' on every endpoint.",
)
@click.option(
    "--forward",
    default=None,
    envvar=_env("FORWARD"),
    show_envvar=True,
    help="Re-export every request to this OTLP/HTTP URL (e.g. a collector).",
)
@click.option(
    "--forward-queue",
    type=int,
    default=DEFAULT_FORWARD_QUEUE,
    show_default=True,
    envvar=_env("FORWARD_QUEUE"),
    show_envvar=True,
    help="Requests waiting for the upstream before drops.",
)
@click.option(
    "--idle-timeout",
    default="60s",
    show_default=True,
    envvar=_env("IDLE_TIMEOUT"),
    show_envvar=True,
    help="Silence after which a run of a process without heartbeats is orphaned.",
)
@click.option(
    "--retention",
    default="7d",
    show_default=True,
    envvar=_env("RETENTION"),
    show_envvar=True,
    help="Keep finished runs this long.",
)
@click.option(
    "--max-body",
    default="16MiB",
    show_default=True,
    envvar=_env("MAX_BODY"),
    show_envvar=True,
    help="Largest OTLP request, compressed or decompressed.",
)
@click.option(
    "--max-in-flight",
    type=int,
    default=DEFAULT_MAX_IN_FLIGHT,
    show_default=True,
    envvar=_env("MAX_IN_FLIGHT"),
    show_envvar=True,
    help="Requests handled at once before 429 / UNAVAILABLE.",
)
@click.option(
    "--body-timeout",
    default="30s",
    show_default=True,
    envvar=_env("BODY_TIMEOUT"),
    show_envvar=True,
    help="A request body must arrive whole within this, or the request is cut "
    "(OTLP: 503 + Retry-After, which exporters retry; API: 408).",
)
@click.option(
    "--body-min-rate",
    default="16KiB",
    show_default=True,
    envvar=_env("BODY_MIN_RATE"),
    show_envvar=True,
    help="Slowest average body rate per second accepted after the first 2 s (HTTP).",
)
@click.option(
    "--max-receiving",
    type=int,
    default=DEFAULT_MAX_RECEIVING,
    show_default=True,
    envvar=_env("MAX_RECEIVING"),
    show_envvar=True,
    help="Requests whose body is still arriving, at once, before 429 / RESOURCE_EXHAUSTED.",
)
@click.option(
    "--keepalive-timeout",
    default="10s",
    show_default=True,
    envvar=_env("KEEPALIVE_TIMEOUT"),
    show_envvar=True,
    help="Close a connection that sends no whole request head within this long of opening "
    "or of its last answer (idle, or slow headers); gRPC: its HTTP/2 preface, or a call.",
)
@click.option(
    "--max-connections",
    type=int,
    default=None,
    envvar=_env("MAX_CONNECTIONS"),
    show_envvar=True,
    help="Connections each port holds at once; the next are closed on arrival. Lowered "
    f"to fit the process's file descriptor limit (ulimit -n) [default: "
    f"{DEFAULT_MAX_CONNECTIONS}, or what the limit allows].",
)
@click.option(
    "--ready-stall",
    default=f"{DEFAULT_READY_STALL:g}s",
    show_default=True,
    envvar=_env("READY_STALL"),
    show_envvar=True,
    help="GET /readyz answers 503 while a request has waited longer than this for its "
    "database commit (the SagaSidecarIntakeStalled rule's threshold); /healthz stays 200.",
)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    envvar=_env("LOG_LEVEL"),
    show_envvar=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@alert_options
def serve(
    host: str,
    otlp_http_port: int,
    otlp_grpc_port: int,
    api_port: int,
    db: str | None,
    token: str | None,
    forward: str | None,
    forward_queue: int,
    idle_timeout: str,
    retention: str,
    max_body: str,
    max_in_flight: int,
    body_timeout: str,
    body_min_rate: str,
    max_receiving: int,
    keepalive_timeout: str,
    max_connections: int | None,
    ready_stall: str,
    log_level: str,
    **alerting: Any,
) -> None:
    """Receive OTLP traces, keep run state, serve the API, raise alerts (docs/alerting.md).

    Prints one JSON line {"event": "sidecar.listening", ...} with the bound ports.
    """
    # grpc's C core prints its own bind errors to stderr; ours say the same in one line.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    # Imported here, after the variable: grpc reads it when it is first loaded.
    from ._alert_service import install_alerting
    from ._gcfreeze import freeze_loop
    from ._server import Sidecar

    configure_logging(log_level)
    try:
        target = parse_db(db) if db is not None else None
        settings = Settings(
            host=host,
            otlp_http_port=otlp_http_port,
            otlp_grpc_port=otlp_grpc_port,
            api_port=api_port,
            db_path=target.path if target is not None else None,
            db_url=target.url if target is not None else None,
            token=token,
            forward=forward,
            forward_queue=forward_queue,
            idle_timeout=parse_duration(idle_timeout, "--idle-timeout"),
            retention=parse_duration(retention, "--retention"),
            max_body=parse_size(max_body, "--max-body"),
            max_in_flight=max_in_flight,
            body_timeout=parse_duration(body_timeout, "--body-timeout"),
            body_min_rate=parse_size(body_min_rate, "--body-min-rate"),
            max_receiving=max_receiving,
            keepalive_timeout=parse_duration(keepalive_timeout, "--keepalive-timeout"),
            max_connections=max_connections,
            ready_stall=parse_duration(ready_stall, "--ready-stall"),
        )
        sidecar = Sidecar(settings)
        install_alerting(sidecar, settings_from_options(alerting))
        # This process is the sidecar's alone: keep full GC pauses short (see _gcfreeze).
        sidecar.add_background(freeze_loop)
        asyncio.run(_serve(sidecar))
    except SidecarError as exc:
        raise click.ClickException(str(exc)) from exc


async def _serve(sidecar: Sidecar) -> None:
    stop = asyncio.Event()
    received: list[str] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal, sig)
    async with sidecar:
        click.echo(json.dumps(sidecar.listening()))
        sys.stdout.flush()
        await stop.wait()
        log.info("sidecar.stopping", signal=received[0] if received else None)
    log.info("sidecar.stopped")


# --- runs: API client -------------------------------------------------------------

_api_option = click.option(
    "--api",
    default=DEFAULT_API,
    show_default=True,
    envvar=_env("API"),
    show_envvar=True,
    help="Base URL of the sidecar API.",
)
_token_option = click.option(
    "--token",
    default=None,
    envvar=_env("TOKEN"),
    show_envvar=True,
    help="Bearer token of the sidecar.",
)


def _request(api: str, token: str | None, method: str, path: str, **kw: Any) -> dict[str, Any]:
    parts = urlsplit(api)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ApiError(
            f"--api {api!r} is not a URL: give the scheme and address, e.g. "
            f"--api http://127.0.0.1:{DEFAULT_API_PORT} (or set SAGA_SIDECAR_API)"
        )
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.request(method, api.rstrip("/") + path, headers=headers, timeout=10, **kw)
    except httpx.HTTPError as exc:
        raise ApiError(
            f"cannot reach the sidecar API at {api} ({exc}): is `saga-sidecar serve` running? "
            "Point --api (SAGA_SIDECAR_API) at it"
        ) from exc
    try:
        body = resp.json()
    except ValueError as exc:
        raise ApiError(f"{api}{path} answered {resp.status_code} with non-JSON") from exc
    if resp.status_code >= 400:
        message = str(body.get("error") if isinstance(body, dict) else body)
        raise ApiError(message, resp.status_code, body if isinstance(body, dict) else None)
    if not isinstance(body, dict):
        raise ApiError(f"{api}{path} answered with {type(body).__name__}, expected an object")
    return body


PREFIX_PAGE = 1000  # runs read to resolve a prefix; past it the answer says "more than"


def _on_run(
    api: str, token: str | None, method: str, given: str, suffix: str = "", **kw: Any
) -> dict[str, Any]:
    """``method /runs/{id}{suffix}`` for the run ``given`` names: a whole id (pasted from
    an alert) costs one request; only when no run has that id is it taken as a prefix
    (the contract's rule) and the request made for the one run it names."""
    try:
        return _request(api, token, method, f"/runs/{sc.run_id_segment(given)}{suffix}", **kw)
    except ApiError as exc:
        if exc.status != 404:
            raise
    page = {"id_prefix": given, "limit": PREFIX_PAGE}
    body = _request(api, token, "GET", "/runs", params=page)
    run_id, problem = sc.run_id_match_problem(
        given, (str(r["run_id"]) for r in body["runs"]), more=bool(body.get("next_cursor"))
    )
    if run_id is None:
        raise ApiError(str(problem))
    return _request(api, token, method, f"/runs/{sc.run_id_segment(run_id)}{suffix}", **kw)


@main.group()
def runs() -> None:
    """List, show and resolve runs (talks to the API)."""


def _fail(exc: SidecarError) -> click.ClickException:
    return click.ClickException(str(exc))


@runs.command("list")
@_api_option
@_token_option
@click.option("--status", default=None, help="Only runs in this state.")
@click.option("--saga", default=None, help="Only runs of this saga.")
@click.option("--needs-person", is_flag=True, help="Only unresolved failed/stuck/orphaned runs.")
@click.option("--limit", type=int, default=50, show_default=True)
@click.option("--cursor", default=None, help="Go on from where a listing stopped (it says so).")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
def list_runs(
    api: str,
    token: str | None,
    status: str | None,
    saga: str | None,
    needs_person: bool,
    limit: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """List runs, newest first, --limit at a time."""
    params: dict[str, Any] = {"limit": limit}
    if cursor:
        params["cursor"] = cursor
    if status:
        params["status"] = status
    if saga:
        params["saga"] = saga
    if needs_person:
        params["needs"] = "person"
    try:
        body = _request(api, token, "GET", "/runs", params=params)
    except SidecarError as exc:
        raise _fail(exc) from exc
    if as_json:
        click.echo(json.dumps(body, indent=2))
    else:
        _print_runs(printable_doc(body["runs"]))
    if body.get("next_cursor"):
        # On stderr, so piped output stays rows; without it the oldest runs went unseen.
        click.echo(
            f"more runs than --limit {limit}: run the same command with "
            f"--cursor {body['next_cursor']} for the next ones",
            err=True,
        )


def _print_runs(runs: list[dict[str, Any]]) -> None:
    # Run ids are never cut (they are what the other commands take): at 80 columns the
    # start time goes under the id and the other columns wrap.
    now = time.time()
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("run, started", no_wrap=True)
    table.add_column("saga, status", overflow="fold")
    table.add_column("failed step", overflow="fold")
    table.add_column("left", justify="right", no_wrap=True)
    for r in runs:
        started = r["started_at"]
        at = "-" if started is None else f"{local_time(started)}\n{age(now - started)} ago"
        # Text, not str: a str cell is rich markup, and "[link=...]" in a saga name is not.
        table.add_row(
            Text.assemble(r["run_id"], "\n", (at, "dim")),
            Text(f"{r['saga']}\n{r['status']}" + ("\n(resolved)" if r["resolved"] else "")),
            Text(r["failed_step"] or ""),
            str(r["stack_depth"]),
        )
    _console().print(table)


def _console() -> Console:
    """A terminal's width on a terminal; piped or redirected, wide enough that no id is cut."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console()
    return Console(width=200)


@runs.command("show")
@click.argument("run_id")
@_api_option
@_token_option
@click.option("--json", "as_json", is_flag=True, help="Print the run view JSON.")
def show(run_id: str, api: str, token: str | None, as_json: bool) -> None:
    """Draw one run: forward steps, pivot, unwind, what is left on the stack.

    RUN_ID may be any prefix of the id that no other run shares.
    """
    try:
        view = _on_run(api, token, "GET", run_id)
    except SidecarError as exc:
        raise _fail(exc) from exc
    if as_json:
        click.echo(json.dumps(view, indent=2))
    else:
        # The API serves the run view (docs/internals.md); trust its shape.
        _console().print(render_run(cast(RunView, view)))


@runs.command("stack")
@click.argument("run_id")
@_api_option
@_token_option
@click.option("--json", "as_json", is_flag=True, help="Print {run_id, status, stack} JSON.")
def stack(run_id: str, api: str, token: str | None, as_json: bool) -> None:
    """The compensations still owed, top first (what saga_otel.recover() takes).

    RUN_ID may be any prefix of the id that no other run shares.
    """
    try:
        body = _on_run(api, token, "GET", run_id, "/stack")
    except SidecarError as exc:
        raise _fail(exc) from exc
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    body = printable_doc(body)
    click.echo(f"run {body['run_id']} ({body['status']}): {len(body['stack'])} left")
    for item in body["stack"]:
        click.echo(f"  #{item['index']} {item['step']}: {item['tool']} {json.dumps(item['args'])}")


def login_name() -> str | None:
    """Who runs the command, by the login name (``getpass.getuser``: LOGNAME, USER,
    ..., then the password database); None when it cannot tell (a container's uid with
    no name), and then the resolution names no one rather than a made-up name."""
    try:
        return getpass.getuser() or None
    except (OSError, KeyError, ImportError):  # 3.13 raises OSError; before, pwd's KeyError
        return None


@runs.command("resolve")
@click.argument("run_id")
@click.option("--note", required=True, help="What a person did or decided.")
@click.option(
    "--by",
    default=None,
    metavar="NAME",
    help="Who resolved it, kept with the note (audit trail, the alert's resolution). "
    "Default: your login name; --by '' names no one.",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Put this note in place of the one a run resolved already has (else refused).",
)
@_api_option
@_token_option
def resolve(
    run_id: str, note: str, by: str | None, replace: bool, api: str, token: str | None
) -> None:
    """Record that a person settled the run.

    RUN_ID may be any prefix of the id that no other run shares. A run resolved
    already keeps its note: resolving it again with the same note changes nothing
    (whoever --by names), with another is refused (showing the note that stands)
    unless --replace.
    """
    name = login_name() if by is None else by.strip()
    body: dict[str, Any] = {"note": note, **({"replace": True} if replace else {})}
    if name:
        body["by"] = name
    try:
        view = _on_run(api, token, "POST", run_id, "/resolve", json=body)
    except ApiError as exc:
        standing = exc.body.get("resolution") if exc.status == 409 and exc.body else None
        if isinstance(standing, dict):
            raise _resolved_already(run_id, note, by, standing) from exc
        raise _fail(exc) from exc
    except SidecarError as exc:
        raise _fail(exc) from exc
    view = printable_doc(view)
    resolution = view["resolution"]
    click.echo(
        f"resolved {view['run_id']} ({view['status']}){_by(resolution)}: {resolution['note']}"
    )


def _by(resolution: dict[str, Any]) -> str:
    """The ' by NAME' of a resolution that names its person; else nothing."""
    by = resolution.get("by")
    return f" by {by}" if isinstance(by, str) and by else ""


def _resolved_already(
    given: str, note: str, by: str | None, standing: dict[str, Any]
) -> click.ClickException:
    """The API's 409: someone resolved the run first; show their note and the way to
    replace it (with the --by given, if one was), every outside text escaped."""
    at = standing.get("at")
    when_text = when(at, time.time()) if isinstance(at, int | float) else "-"
    named = f" --by {shlex.quote(by)}" if by is not None else ""
    again = (
        f"saga-sidecar runs resolve {shlex.quote(given)} --note {shlex.quote(note)}{named} "
        "--replace"
    )
    return click.ClickException(
        "\n".join(
            printable(line)
            for line in (
                f"run {given} is already resolved; your note was not saved.",
                f"  resolved {when_text}{_by(standing)}: {standing.get('note')}",
                f"  your note: {note}",
                f"  to put yours in its place: {again}",
            )
        )
    )
