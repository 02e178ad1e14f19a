"""Alerting settings of ``saga-sidecar serve``: plain values, the click options that set them.

Every option also reads ``SAGA_SIDECAR_<NAME>`` (repeatable ones: space-separated).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click

from ._alerting import DEFAULT_RUNBOOK_BASE, RuleConfig
from ._errors import ConfigError
from ._outbox import Backoff, Routing
from ._redact import Redactor
from ._settings import ENV_PREFIX, parse_duration
from ._sinks import (
    DEFAULT_PAGERDUTY_URL,
    DEFAULT_TIMEOUT,
    AlertmanagerSink,
    LogSink,
    PagerDutySink,
    Sink,
    WebhookSink,
)

DEFAULT_RESEND = 60.0


@dataclass(frozen=True, slots=True)
class AlertSettings:
    """``public_url`` None: links use the API address the sidecar actually bound."""

    public_url: str | None = None
    runbook_base: str = DEFAULT_RUNBOOK_BASE
    alertmanager_urls: tuple[str, ...] = ()
    alertmanager_resend: float = DEFAULT_RESEND
    pagerduty_routing_key: str | None = None
    pagerduty_url: str = DEFAULT_PAGERDUTY_URL
    webhook_urls: tuple[str, ...] = ()
    log_sink: bool = True
    routes: tuple[str, ...] = ()
    redact_keys: tuple[str, ...] = ()
    redact_patterns: tuple[str, ...] = ()
    timeout: float = DEFAULT_TIMEOUT
    backoff_initial: float = 0.5
    backoff_max: float = 15.0  # alerts are urgent: probe a recovering sink often
    late_compensation: bool = True

    def __post_init__(self) -> None:
        # A sink URL with no host or a bad port would make every alert to it wait, retried,
        # until someone saw the backlog: each is refused here, naming its flag.
        named = [
            *([("--public-url", self.public_url)] if self.public_url else []),
            *(("--alertmanager", url) for url in self.alertmanager_urls),
            ("--pagerduty-url", self.pagerduty_url),
            *(("--webhook", url) for url in self.webhook_urls),
        ]
        for flag, url in named:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"{flag} {url!r} is not an http(s) URL: write e.g. http://127.0.0.1:9093"
                )
            if not _has_host(url):
                example = (
                    "the API as people reach it, e.g. https://saga.example.org or "
                    "http://10.0.0.5:4320"
                    if flag == "--public-url"
                    else "e.g. http://127.0.0.1:9093/path"
                )
                raise ConfigError(f"{flag} {url!r} names no host (or a bad port): write {example}")
        # Either would leave PagerDuty off without a word: an empty key is what an unset
        # variable makes of `--pagerduty-routing-key=$PD_KEY` in a unit file.
        key = self.pagerduty_routing_key
        if key is not None and not key.strip():
            raise ConfigError(
                "--pagerduty-routing-key is empty (an unset variable, such as $PD_KEY in a "
                "unit file?), so PagerDuty would be off: give the integration key of the "
                "service's Events API v2 integration, or leave the flag out"
            )
        if not key and self.pagerduty_url != DEFAULT_PAGERDUTY_URL:
            raise ConfigError(
                f"--pagerduty-url {self.pagerduty_url!r} is given without "
                "--pagerduty-routing-key, so PagerDuty would be off: give the key too "
                "(or SAGA_SIDECAR_PAGERDUTY_ROUTING_KEY), or leave --pagerduty-url out"
            )
        if self.alertmanager_resend <= 0 or self.timeout <= 0:
            raise ConfigError(
                f"alertmanager_resend={self.alertmanager_resend} and timeout={self.timeout} "
                "must be positive seconds"
            )
        if not self.backoff_max >= self.backoff_initial:
            raise ConfigError(
                f"--alert-retry-max {self.backoff_max:g}s is shorter than the first retry's "
                f"wait ({self.backoff_initial:g}s): give at least {self.backoff_initial:g}s, "
                "e.g. --alert-retry-max 15s (the default)"
            )
        # Fail at startup, not at the first alert.
        self.routing()
        self.redactor()
        self.backoff()

    def rule_config(self, api_url: str | None = None) -> RuleConfig:
        """Links to ``public_url``, else to ``api_url`` (the bound API), else the default."""
        public = self.public_url or api_url
        late = self.late_compensation
        if public is None:
            return RuleConfig(runbook_base=self.runbook_base, late_compensation=late)
        return RuleConfig(public_url=public, runbook_base=self.runbook_base, late_compensation=late)

    def routing(self) -> Routing:
        return Routing.parse(self.routes)

    def redactor(self) -> Redactor:
        return Redactor.build(self.redact_keys, self.redact_patterns)

    def backoff(self) -> Backoff:
        return Backoff(initial=self.backoff_initial, maximum=self.backoff_max)

    def sinks(self) -> list[Sink]:
        redactor = self.redactor()
        sinks: list[Sink] = [
            AlertmanagerSink(
                url, redactor=redactor, resend=self.alertmanager_resend, timeout=self.timeout
            )
            for url in dict.fromkeys(self.alertmanager_urls)
        ]
        if self.pagerduty_routing_key:
            sinks.append(
                PagerDutySink(
                    self.pagerduty_routing_key,
                    url=self.pagerduty_url,
                    redactor=redactor,
                    timeout=self.timeout,
                )
            )
        sinks += [
            WebhookSink(url, redactor=redactor, timeout=self.timeout)
            for url in dict.fromkeys(self.webhook_urls)
        ]
        if self.log_sink:
            sinks.append(LogSink(redactor=redactor))
        return sinks


def _has_host(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not one)
    except ValueError:
        return False
    return bool(parts.hostname)


F = TypeVar("F", bound=Callable[..., Any])


def _duration(_ctx: click.Context, param: click.Parameter, value: Any) -> float:
    try:
        return parse_duration(value, f"--{(param.name or '').replace('_', '-')}")
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc


_OPTIONS: Sequence[Callable[[F], F]] = (
    click.option(
        "--public-url",
        envvar=ENV_PREFIX + "PUBLIC_URL",
        show_envvar=True,
        default=None,
        help="The sidecar API as people reach it; alerts link runs to {url}/runs/{id}, the "
        "run's page in a browser.  [default: the API address actually bound, e.g. "
        "http://127.0.0.1:4320]",
    ),
    click.option(
        "--runbook-base",
        envvar=ENV_PREFIX + "RUNBOOK_BASE",
        show_envvar=True,
        default=DEFAULT_RUNBOOK_BASE,
        show_default=True,
        help="Runbook page; each alert links {base}#{alertname in lower case}.",
    ),
    click.option(
        "--alertmanager",
        "alertmanager_urls",
        envvar=ENV_PREFIX + "ALERTMANAGER",
        show_envvar=True,
        multiple=True,
        metavar="URL",
        help="Alertmanager base URL (repeat for HA peers: each gets every alert).",
    ),
    click.option(
        "--alertmanager-resend",
        envvar=ENV_PREFIX + "ALERTMANAGER_RESEND",
        show_envvar=True,
        default="60s",
        show_default=True,
        callback=_duration,
        help="Re-send still-firing alerts to Alertmanager this often.",
    ),
    click.option(
        "--pagerduty-routing-key",
        envvar=ENV_PREFIX + "PAGERDUTY_ROUTING_KEY",
        show_envvar=True,
        default=None,
        help="PagerDuty Events API v2 integration key; enables the PagerDuty sink.",
    ),
    click.option(
        "--pagerduty-url",
        envvar=ENV_PREFIX + "PAGERDUTY_URL",
        show_envvar=True,
        default=DEFAULT_PAGERDUTY_URL,
        show_default=True,
        help="PagerDuty Events API v2 endpoint.",
    ),
    click.option(
        "--webhook",
        "webhook_urls",
        envvar=ENV_PREFIX + "WEBHOOK",
        show_envvar=True,
        multiple=True,
        metavar="URL",
        help="POST every alert as JSON to this URL (repeatable).",
    ),
    click.option(
        "--alert-log/--no-alert-log",
        envvar=ENV_PREFIX + "ALERT_LOG",
        show_envvar=True,
        default=True,
        show_default=True,
        help="Write every alert as a JSON log line (the 'log' sink).",
    ),
    click.option(
        "--route",
        "routes",
        envvar=ENV_PREFIX + "ROUTE",
        show_envvar=True,
        multiple=True,
        metavar="SEVERITY=SINK[,SINK]",
        help="Send a severity only to these sink kinds (alertmanager, pagerduty, webhook, "
        "log), e.g. --route critical=pagerduty,webhook. Default: every sink gets every "
        "severity.",
    ),
    click.option(
        "--redact-key",
        "redact_keys",
        envvar=ENV_PREFIX + "REDACT_KEY",
        show_envvar=True,
        multiple=True,
        metavar="NAME",
        help="Mask tool arguments with this exact name in every alert (repeatable).",
    ),
    click.option(
        "--redact-pattern",
        "redact_patterns",
        envvar=ENV_PREFIX + "REDACT_PATTERN",
        show_envvar=True,
        multiple=True,
        metavar="REGEX",
        help="Mask tool arguments whose name matches this regex (re.search; repeatable).",
    ),
    click.option(
        "--late-compensation-alerts/--no-late-compensation-alerts",
        "late_compensation",
        envvar=ENV_PREFIX + "LATE_COMPENSATION_ALERTS",
        show_envvar=True,
        default=True,
        show_default=True,
        help="When an unwind arrives together with its run's end (a batching exporter), "
        "still fire SagaCompensationStarted and resolve it at once, marked late.",
    ),
    click.option(
        "--alert-retry-max",
        default="15s",
        show_default=True,
        envvar=ENV_PREFIX + "ALERT_RETRY_MAX",
        show_envvar=True,
        callback=_duration,
        help="Longest wait between delivery retries to a failing sink (backoff cap).",
    ),
    click.option(
        "--alert-timeout",
        envvar=ENV_PREFIX + "ALERT_TIMEOUT",
        show_envvar=True,
        default="10s",
        show_default=True,
        callback=_duration,
        help="Timeout of one request to an alert sink.",
    ),
)

ALERT_OPTION_NAMES = (
    "public_url",
    "runbook_base",
    "alertmanager_urls",
    "alertmanager_resend",
    "pagerduty_routing_key",
    "pagerduty_url",
    "webhook_urls",
    "alert_log",
    "routes",
    "redact_keys",
    "redact_patterns",
    "alert_timeout",
    "alert_retry_max",
    "late_compensation",
)


def alert_options(func: F) -> F:
    """Add the alerting options to a click command (``serve``)."""
    for option in reversed(_OPTIONS):
        func = option(func)
    return func


def settings_from_options(options: dict[str, Any]) -> AlertSettings:
    """Pop the alerting options out of a command's kwargs into :class:`AlertSettings`."""
    values = {name: options.pop(name) for name in ALERT_OPTION_NAMES if name in options}
    return AlertSettings(
        public_url=values.get("public_url") or None,
        runbook_base=values.get("runbook_base", DEFAULT_RUNBOOK_BASE),
        alertmanager_urls=tuple(values.get("alertmanager_urls", ())),
        alertmanager_resend=float(values.get("alertmanager_resend", DEFAULT_RESEND)),
        pagerduty_routing_key=values.get("pagerduty_routing_key"),
        pagerduty_url=values.get("pagerduty_url", DEFAULT_PAGERDUTY_URL),
        webhook_urls=tuple(values.get("webhook_urls", ())),
        log_sink=bool(values.get("alert_log", True)),
        routes=tuple(values.get("routes", ())),
        redact_keys=tuple(values.get("redact_keys", ())),
        redact_patterns=tuple(values.get("redact_patterns", ())),
        timeout=float(values.get("alert_timeout", DEFAULT_TIMEOUT)),
        backoff_max=float(values.get("alert_retry_max", 15.0)),
        late_compensation=bool(values.get("late_compensation", True)),
    )
