"""Where alerts go: Alertmanager API v2, PagerDuty Events API v2, a JSON webhook, the log.

A sink turns one :class:`AlertEvent` into one request and reports how it went
by raising: :class:`DeliveryRetry` for what may work later (429, 5xx,
connection errors, timeouts) and :class:`DeliveryRejected` for what never will
(other 4xx, and a redirect: a configuration error). Retrying, ordering and durability are the
outbox's job. Every payload is redacted here, at the last step before it
leaves the process.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, ClassVar, Final, Protocol, TextIO
from urllib.parse import urljoin, urlsplit

import aiohttp
import structlog

from ._alerting import AlertEvent
from ._errors import SidecarError
from ._redact import Redactor

KIND_ALERTMANAGER: Final = "alertmanager"
KIND_PAGERDUTY: Final = "pagerduty"
KIND_WEBHOOK: Final = "webhook"
KIND_LOG: Final = "log"
SINK_KINDS: Final = (KIND_ALERTMANAGER, KIND_PAGERDUTY, KIND_WEBHOOK, KIND_LOG)

DEFAULT_PAGERDUTY_URL: Final = "https://events.pagerduty.com/v2/enqueue"
DEFAULT_TIMEOUT: Final = 10.0
_MAX_BODY_IN_ERROR: Final = 2000
# Bytes of a sink's answer read, whatever its status: enough for an error's text; the
# rest is dropped with the connection (an answer of 512 MiB, read whole, took the
# sidecar to 1 GiB).
_MAX_ANSWER_READ: Final = 8 * 1024
_PD_SUMMARY_MAX: Final = 1024
# Bounds of a body, in bytes of its JSON. PagerDuty refuses an event over 512 KB with 400
# (not retried: the page is lost; Alertmanager's own PagerDuty integration uses 512,000);
# a webhook receiver commonly takes at most 1 MiB (nginx's client_max_body_size, aiohttp's
# client_max_size) and answers 413 past it. Alertmanager sets no bound of its own.
PAGERDUTY_BODY_MAX: Final = 500_000
WEBHOOK_BODY_MAX: Final = 1_000_000
# Characters of one text in a PagerDuty event's details (or a webhook body over its bound)
# before it is cut: a failure message quoting an HTML page, repeated in the description,
# the card and the unwind reason, made an event of megabytes.
TEXT_MAX: Final = 8 * 1024


class DeliveryError(SidecarError):
    """A sink did not accept an alert."""


class DeliveryRetry(DeliveryError):
    """Worth trying again later; ``retry_after`` is the sink's own hint in seconds."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeliveryRejected(DeliveryError):
    """The sink refused the alert for good (4xx other than 429, or a redirect): fix the
    configuration."""


class Sink(Protocol):
    @property
    def kind(self) -> str:
        """One of :data:`SINK_KINDS`: what routes name and metrics label."""

    @property
    def name(self) -> str:
        """Unique and stable across restarts: the outbox keys rows by it."""

    @property
    def resend_interval(self) -> float | None:
        """Seconds between re-sends of a still-firing alert, or None for never."""

    async def send(self, event: AlertEvent) -> None: ...

    async def close(self) -> None: ...


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def shown_url(url: str) -> str:
    """``url`` fit to show in logs, errors and pages: scheme, host and port only.

    Webhook URLs often carry their secret in the path or query (Slack's and Teams'
    incoming webhooks do), and any URL may carry a password as user info; those
    parts become ``…``. The full URL stays in the configuration and the sink's
    identity (the outbox's ``sink`` column), which never leave the machine.
    """
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return "…" if url else url
    host = parts.netloc.rpartition("@")[2]
    rest = parts.path not in ("", "/") or parts.query or parts.fragment
    return f"{parts.scheme}://{host}{'/…' if rest else ''}"


def shown_sink(name: str) -> str:
    """A sink's name (``kind:url``, or ``log``) with its URL as :func:`shown_url` shows it."""
    kind, sep, url = name.partition(":")
    return f"{kind}:{shown_url(url)}" if sep and "://" in url else name


def _shown_location(url: str, location: str | None) -> str:
    """Where a redirect from ``url`` points, as :func:`shown_url` shows a URL: its path may
    hold the sink's secret as well (an http -> https move keeps it), so only whether it is
    ``url``'s own path is said."""
    if not location:
        return "nowhere (no Location header)"
    try:
        target = urljoin(url, location)
        old, new = urlsplit(url), urlsplit(target)
        shown = shown_url(target)
    except ValueError:
        return "a Location that is no URL"
    same = (old.path, old.query) == (new.path, new.query)
    return f"{shown} ({'the same path' if same else 'another path'})"


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds from a Retry-After header (delta seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - now)
    except (TypeError, ValueError):
        return None


@dataclass
class _Http:
    """One aiohttp session per sink, opened lazily inside the running loop."""

    timeout: float
    _session: aiohttp.ClientSession | None = field(default=None, init=False)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers={"User-Agent": "saga-sidecar"},
            )
        return self._session

    async def post(self, url: str, body: Any, what: str) -> None:
        now = datetime.now(UTC).timestamp()
        where = shown_url(url)  # errors are logged and shown on the run page
        try:
            # A redirect is not followed: aiohttp (as browsers) turns a POST answered 301,
            # 302 or 303 into a GET without the body, whose 200 would mark the alert
            # delivered though no sink ever saw it.
            async with self.session().post(url, json=body, allow_redirects=False) as resp:
                if 200 <= resp.status < 300:
                    # Read (a short answer lets the connection be reused), but bounded.
                    await _head(resp, _MAX_ANSWER_READ)
                    return
                if 300 <= resp.status < 400:
                    status = f"{resp.status} {resp.reason or ''}".strip()
                    to = _shown_location(url, resp.headers.get("Location"))
                    raise DeliveryRejected(
                        f"{what} at {where} answered {status}, redirecting to {to}: alerts do "
                        "not follow redirects (the POST would arrive as a GET without the "
                        "alert); point the flag at the final URL (`curl -sI` on the URL shows "
                        "its Location)"
                    )
                text = _decoded(resp, await _head(resp, _MAX_ANSWER_READ))[:_MAX_BODY_IN_ERROR]
                if resp.status == 429 or resp.status >= 500:
                    raise DeliveryRetry(
                        f"{what} at {where} answered {resp.status}: {text}",
                        parse_retry_after(resp.headers.get("Retry-After"), now),
                    )
                raise DeliveryRejected(
                    f"{what} at {where} refused the alert with {resp.status}: {text}; this will "
                    "not pass on retry, check the sink's URL and credentials (routing key)"
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # aiohttp's own text can quote the URL (an invalid URL, a redirect's target).
            told = str(exc).replace(url, where)
            raise DeliveryRetry(
                f"{what} at {where} unreachable: {type(exc).__name__}: {told}"
            ) from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _head(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most ``limit`` bytes of ``resp``'s body: leaving the body unread, the response's
    release closes the connection rather than drain it."""
    parts: list[bytes] = []
    got = 0
    while got < limit:
        chunk = await resp.content.read(limit - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _decoded(resp: aiohttp.ClientResponse, body: bytes) -> str:
    try:
        return body.decode(resp.charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")


def _redacted(redactor: Redactor, event: AlertEvent, payload: Any) -> Any:
    secrets = redactor.secrets_in(event.details, dict(event.annotations))
    return redactor.redact(payload, secrets)


def _json_size(value: Any) -> int:
    # As aiohttp's json= sends it (json.dumps, ASCII-escaped: characters are bytes).
    return len(json.dumps(value))


def cut_texts(value: Any, run_url: str, limit: int = TEXT_MAX) -> Any:
    """``value`` with every string longer than ``limit`` characters cut to that many and
    ending with a marker saying so and where the whole is (the run's page); dict keys,
    numbers and the structure stay as they are."""
    if isinstance(value, str):
        if len(value) <= limit:
            return value
        where = run_url or "the run's page"
        return f"{value[:limit]}… [cut: {len(value) - limit:,} more characters; see {where}]"
    if isinstance(value, dict):
        return {k: cut_texts(v, run_url, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [cut_texts(v, run_url, limit) for v in value]
    return value


_NEVER_LEFT_OUT: Final = frozenset({"run_url", "runbook_url"})


def fit_body(
    body: dict[str, Any], parts: list[dict[str, Any]], limit: int, run_url: str, why: str
) -> dict[str, Any]:
    """``body`` (changed in place, and returned) in at most ``limit`` bytes of JSON: while
    it is over, the largest field of ``parts`` (dicts inside ``body``; a field inside a
    nested dict counts on its own, a list as one) is replaced by a note naming
    ``run_url``. Fields too small to shrink that way (a card of many short keys) go as
    whole nested dicts, and last as whole parts. The URLs stay; what is outside
    ``parts`` stays."""
    size = _json_size(body)
    if size <= limit:
        return body

    def note(field_size: int) -> str:
        return f"[left out: {field_size:,} bytes, {why}; see {run_url or 'the run page'}]"

    fields: list[tuple[int, dict[str, Any], str]] = []
    nested: list[tuple[int, dict[str, Any], str]] = []

    def collect(container: dict[str, Any]) -> bool:
        """Collects ``container``'s fields; True if it holds a URL that stays."""
        keeps = False
        for key, value in container.items():
            if isinstance(value, dict) and value:
                if collect(value):
                    keeps = True
                else:
                    nested.append((_json_size(value), container, key))
            elif key in _NEVER_LEFT_OUT:
                keeps = True
            else:
                fields.append((_json_size(value), container, key))
        return keeps

    for part in parts:
        collect(part)
    # Replacing one value changes the JSON by the difference of the two values' sizes.
    for field_size, container, key in sorted(fields, key=lambda f: f[0], reverse=True):
        if size <= limit:
            return body
        if _json_size(note(field_size)) >= field_size:
            break  # the rest are smaller than a note
        container[key] = note(field_size)
        size += _json_size(container[key]) - field_size
    # Many small leaves: whole nested dicts, then whole parts (their URLs kept). An outer
    # dict is measured as it is now, after its inner ones may have gone.
    for _, container, key in sorted(nested, key=lambda f: f[0], reverse=True):
        if size <= limit:
            return body
        if isinstance(container.get(key), dict):
            container[key] = note(_json_size(container[key]))
            size = _json_size(body)
    for part in sorted(parts, key=_json_size, reverse=True):
        if size <= limit:
            return body
        kept = {k: v for k, v in part.items() if k in _NEVER_LEFT_OUT}
        left = _json_size({k: v for k, v in part.items() if k not in _NEVER_LEFT_OUT})
        part.clear()
        part.update(kept, left_out=note(left))
        size = _json_size(body)
    return body


class _HttpSink:
    """What the HTTP sinks share: one client, a name for metrics and logs, and close()."""

    KIND: ClassVar[str]
    url: str
    timeout: float
    _http: _Http

    def __post_init__(self) -> None:
        self._http = _Http(self.timeout)

    @property
    def kind(self) -> str:
        return self.KIND

    @property
    def name(self) -> str:
        return f"{self.KIND}:{self.url}"

    @property
    def resend_interval(self) -> float | None:
        return None

    async def close(self) -> None:
        await self._http.close()


@dataclass
class AlertmanagerSink(_HttpSink):
    """POST /api/v2/alerts of one Alertmanager. Give each HA peer its own sink."""

    KIND: ClassVar[str] = KIND_ALERTMANAGER

    url: str
    redactor: Redactor = field(default_factory=Redactor)
    resend: float | None = 60.0
    timeout: float = DEFAULT_TIMEOUT
    _http: _Http = field(init=False)

    @property
    def resend_interval(self) -> float | None:
        return self.resend

    def payload(self, event: AlertEvent) -> list[dict[str, Any]]:
        alert: dict[str, Any] = {
            "labels": dict(event.labels),
            "annotations": {k: v for k, v in event.annotations.items() if v},
            "startsAt": iso(event.starts_at),
            "generatorURL": event.annotations.get("run_url", ""),
        }
        if not event.firing:
            # Alertmanager rejects an end before the start.
            alert["endsAt"] = iso(max(event.at, event.starts_at))
        return [_redacted(self.redactor, event, alert)]

    async def send(self, event: AlertEvent) -> None:
        await self._http.post(
            f"{self.url.rstrip('/')}/api/v2/alerts", self.payload(event), "Alertmanager"
        )


_PD_DEDUP_MAX: Final = 255  # PagerDuty's Events API v2 refuses a longer dedup_key (400)


def pagerduty_dedup_key(key: str) -> str:
    """``key`` as PagerDuty takes it: a key past 255 characters (a run id may have 256)
    keeps its head and ends in a hash of the whole, the same for a fire and its resolve,
    so a long run id's alert is not refused for good."""
    if len(key) <= _PD_DEDUP_MAX:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return f"{key[: _PD_DEDUP_MAX - len(digest) - 1]}~{digest}"


@dataclass
class PagerDutySink(_HttpSink):
    KIND: ClassVar[str] = KIND_PAGERDUTY

    routing_key: str
    url: str = DEFAULT_PAGERDUTY_URL
    redactor: Redactor = field(default_factory=Redactor)
    timeout: float = DEFAULT_TIMEOUT
    source: str = "saga-sidecar"
    _http: _Http = field(init=False)

    def payload(self, event: AlertEvent) -> dict[str, Any]:
        run_url = event.annotations.get("run_url", "")
        body: dict[str, Any] = {
            "routing_key": self.routing_key,
            "dedup_key": pagerduty_dedup_key(event.dedup_key),
            "event_action": "trigger" if event.firing else "resolve",
        }
        content: dict[str, Any] = {
            "payload": {
                "summary": event.annotations.get("description", event.alertname)[:_PD_SUMMARY_MAX],
                "source": event.labels.get("service") or self.source,
                "severity": event.severity,
                "timestamp": iso(event.at),
                "component": event.labels.get("saga", ""),
                "group": event.labels.get("service", ""),
                "class": event.alertname,
                "custom_details": {
                    "labels": dict(event.labels),
                    # Once each: the details hold the card and the stack (the annotations'
                    # JSON texts of them) and the run's and runbook's URLs.
                    "annotations": {
                        k: v for k, v in event.annotations.items() if k not in event.details
                    },
                    **dict(event.details),
                },
            },
            "links": [
                {"href": run_url, "text": "saga run"},
                {"href": event.annotations.get("runbook_url", ""), "text": "runbook"},
            ],
        }
        # Only the content is redacted: the envelope's routing/dedup keys must stay intact.
        # Cut after redaction: a secret cut in two would no longer be found to mask.
        content = _redacted(self.redactor, event, content)
        payload = content["payload"]
        for key in ("source", "component", "group", "custom_details"):
            payload[key] = cut_texts(payload[key], run_url)
        why = "past what PagerDuty takes in one event"
        out = {**body, **content}
        return fit_body(out, [payload["custom_details"]], PAGERDUTY_BODY_MAX, run_url, why)

    async def send(self, event: AlertEvent) -> None:
        await self._http.post(self.url, self.payload(event), "PagerDuty")


@dataclass
class WebhookSink(_HttpSink):
    KIND: ClassVar[str] = KIND_WEBHOOK

    url: str
    redactor: Redactor = field(default_factory=Redactor)
    timeout: float = DEFAULT_TIMEOUT
    _http: _Http = field(init=False)

    def payload(self, event: AlertEvent) -> dict[str, Any]:
        doc = event_document(event, self.redactor)
        if _json_size(doc) <= WEBHOOK_BODY_MAX:
            return doc  # as it is: a receiver may read every field
        run_url = event.annotations.get("run_url", "")
        parts = ("labels", "annotations", "details")
        for key in parts:
            doc[key] = cut_texts(doc[key], run_url)
        why = f"past the {WEBHOOK_BODY_MAX:,} bytes a webhook body is kept to"
        return fit_body(doc, [doc[key] for key in parts], WEBHOOK_BODY_MAX, run_url, why)

    async def send(self, event: AlertEvent) -> None:
        await self._http.post(self.url, self.payload(event), "webhook")


def event_document(event: AlertEvent, redactor: Redactor) -> dict[str, Any]:
    """The generic JSON form of an alert (webhook body, log line), redacted."""
    doc = {
        "version": "1",
        "action": event.action.value,
        "status": "firing" if event.firing else "resolved",
        "dedup_key": event.dedup_key,
        "alertname": event.alertname,
        "severity": event.severity,
        "run_id": event.run_id,
        "labels": dict(event.labels),
        "annotations": dict(event.annotations),
        "details": dict(event.details),
        "starts_at": iso(event.starts_at),
        "at": iso(event.at),
    }
    out = _redacted(redactor, event, doc)
    assert isinstance(out, dict)
    return out


@dataclass
class LogSink:
    """One JSON line per alert through structlog (stderr unless told otherwise)."""

    redactor: Redactor = field(default_factory=Redactor)
    stream: TextIO | None = None
    _logger: Any = field(init=False)

    def __post_init__(self) -> None:
        self._logger = structlog.wrap_logger(
            structlog.PrintLogger(self.stream or sys.stderr),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.JSONRenderer(sort_keys=True),
            ],
        )

    @property
    def kind(self) -> str:
        return KIND_LOG

    @property
    def name(self) -> str:
        return KIND_LOG

    @property
    def resend_interval(self) -> float | None:
        return None

    async def send(self, event: AlertEvent) -> None:
        doc = event_document(event, self.redactor)
        log = (
            self._logger.error
            if event.firing and event.severity == "critical"
            else (self._logger.warning if event.firing else self._logger.info)
        )
        log("saga.alert", **doc)
        await asyncio.sleep(0)

    async def close(self) -> None:
        return None
