"""configure(): settings from arguments and the environment, and the active setup.

:func:`configure` resolves the endpoint and headers, picks or makes the tracer
provider, adds a :class:`~saga_otel._processor.SagaSpanProcessor` and a
:class:`~saga_otel._heartbeat.Heartbeat`, records the result as the process's
active :class:`SidecarExport` (in :data:`saga_otel._state.STATE`) and shuts it
down at interpreter exit within ``shutdown_timeout``: through ``atexit``, and as a
finalizer of multiprocessing, which ends the children it starts with ``os._exit``
(:func:`_exit_hooks`).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import ssl
import threading
from collections.abc import Mapping, Sequence
from typing import Final
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.util.re import parse_env_headers
from prometheus_client import CollectorRegistry

from saga_otel import semconv as sc
from saga_otel._errors import ConfigurationError
from saga_otel._heartbeat import Heartbeat, open_run_ids
from saga_otel._logging import Logger, default_logger
from saga_otel._presence import Presence
from saga_otel._processor import DEFAULT_MAX_SPAN_BYTES, SagaSpanProcessor
from saga_otel._state import STATE
from saga_otel._text import printable
from saga_otel._transport import Compression, TransportSettings
from saga_otel.records import exception_text

__all__ = ["ENV_SIDECAR_ENDPOINT", "SidecarExport", "configure", "instance_id"]

ENV_SIDECAR_ENDPOINT: Final = "SAGA_OTEL_SIDECAR_ENDPOINT"
# The standard exporter variables (the traces-specific one wins over the
# generic one, an argument of configure() over both). Timeouts are seconds, as
# in the Python SDK's own OTLP exporters.
_ENV_OTLP: Final = "OTEL_EXPORTER_OTLP_"
_ENV_OTLP_TRACES: Final = "OTEL_EXPORTER_OTLP_TRACES_"
_DEFAULT_REQUEST_TIMEOUT: Final = 5.0
_TRACES_PATH: Final = "/v1/traces"
# The SDK's attribute value length limits, the span-specific one first (it wins).
_ENV_LENGTH_LIMITS: Final = (
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
)
# Its attribute count limits, the same way. A saga span carries up to about 20
# attributes; past the count the SDK drops some, and the span breaks the contract.
_ENV_COUNT_LIMITS: Final = ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "OTEL_ATTRIBUTE_COUNT_LIMIT")
_MIN_SPAN_ATTRIBUTES: Final = 64  # the least a provider's count limit may be for saga spans
_OWN_SPAN_ATTRIBUTES: Final = 128  # the SDK's default, for saga_otel's provider under a lower one


def instance_id() -> str:
    """The ``service.instance.id`` this process's saga spans carry.

    The active tracer provider's, when its resource has one (SDKs since 1.3x
    detect a random one, and renew it in a forked child); otherwise the id
    saga_otel puts on a resource it makes, renewed in a forked child by
    ``ProcessState.after_fork_in_child``.
    """
    active = STATE.active
    if isinstance(active, SidecarExport):
        found = active.tracer_provider.resource.attributes.get(sc.SERVICE_INSTANCE_ID)
        if isinstance(found, str) and found:
            return found
    return STATE.instance_id


def _resolve_endpoint(value: str) -> str:
    raw = value.strip()
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigurationError(
            f"sidecar endpoint {value!r} is not an http(s) URL; pass sidecar_endpoint= or set "
            f"{ENV_SIDECAR_ENDPOINT} to the sidecar's OTLP/HTTP base URL, "
            "e.g. http://127.0.0.1:4318 (several replicas: a list, or commas between URLs)"
        )
    path = parts.path if parts.path not in ("", "/") else _TRACES_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _resolve_endpoints(value: str | Sequence[str]) -> tuple[str, ...]:
    """One URL, several separated by commas, or a list of them (sidecar replicas)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    found = tuple(_resolve_endpoint(str(item)) for item in items if str(item).strip())
    if not found:
        raise ConfigurationError(
            f"sidecar endpoint {value!r} names no URL; pass one (or a list, one per sidecar "
            "replica), e.g. http://127.0.0.1:4318"
        )
    return found


def _env(name: str) -> tuple[str, str] | None:
    """(variable, value) of ``OTEL_EXPORTER_OTLP_TRACES_<name>``, else of ``..._OTLP_<name>``."""
    for prefix in (_ENV_OTLP_TRACES, _ENV_OTLP):
        value = os.environ.get(prefix + name, "").strip()
        if value:
            return prefix + name, value
    return None


def _resolve_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    # Both variables apply: generic first, the traces-specific one overrides it.
    for prefix in (_ENV_OTLP, _ENV_OTLP_TRACES):
        raw = os.environ.get(prefix + "HEADERS")
        if raw:
            out.update(parse_env_headers(raw, liberal=True))
    if headers:
        out.update({k.lower(): v for k, v in headers.items()})
    return out


def _resolve_timeout(request_timeout: float | None) -> float:
    if request_timeout is not None:
        where, raw = "request_timeout", str(request_timeout)
    else:
        found = _env("TIMEOUT")
        if found is None:
            return _DEFAULT_REQUEST_TIMEOUT
        where, raw = found
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigurationError(
            f"{where}={raw!r} is not a positive number of seconds; "
            f"use e.g. 5 (default {_DEFAULT_REQUEST_TIMEOUT})"
        )
    return value


def _resolve_compression(compression: str | None) -> Compression:
    where, raw = (
        ("compression", compression)
        if compression is not None
        else (_env("COMPRESSION") or ("", "none"))
    )
    value = raw.strip().lower()
    if value == "gzip":
        return "gzip"
    if value == "none":
        return "none"
    raise ConfigurationError(f"{where}={raw!r} is not a supported compression; use gzip or none")


def _resolve_tls() -> ssl.SSLContext | None:
    """A context from the CERTIFICATE / CLIENT_CERTIFICATE / CLIENT_KEY variables, if any set."""
    ca = _env("CERTIFICATE")
    cert = _env("CLIENT_CERTIFICATE")
    key = _env("CLIENT_KEY")
    if ca is None and cert is None and key is None:
        return None
    try:
        context = ssl.create_default_context(cafile=ca[1] if ca else None)
        if cert is not None:
            context.load_cert_chain(cert[1], keyfile=key[1] if key else None)
        elif key is not None:
            raise ConfigurationError(
                f"{key[0]} is set without a client certificate; set "
                f"{_ENV_OTLP_TRACES}CLIENT_CERTIFICATE too, or unset it"
            )
    except (OSError, ssl.SSLError) as exc:
        names = ", ".join(f"{n}={v!r}" for n, v in (x for x in (ca, cert, key) if x))
        raise ConfigurationError(
            f"cannot load the TLS files named by {names}: {exception_text(exc)}; "
            "point them at PEM files"
        ) from exc
    return context


def _transport(
    headers: Mapping[str, str] | None, request_timeout: float | None, compression: str | None
) -> TransportSettings:
    return TransportSettings(
        headers=_resolve_headers(headers),
        timeout=_resolve_timeout(request_timeout),
        compression=_resolve_compression(compression),
        ssl_context=_resolve_tls(),
    )


def _length_limit_variable() -> tuple[str, str] | None:
    """(variable, value) of the length limit the SDK would put on span attributes, if any."""
    return _limit_variable(_ENV_LENGTH_LIMITS)


def _count_limit_variable() -> tuple[str, str] | None:
    """(variable, value) of a span attribute count limit too low for saga spans, if any
    (one the SDK could not read is its business: it falls back to its default)."""
    found = _limit_variable(_ENV_COUNT_LIMITS)
    if found is None:
        return None
    try:
        low = int(found[1]) < _MIN_SPAN_ATTRIBUTES
    except ValueError:
        return None
    return found if low else None


def _limit_variable(names: tuple[str, str]) -> tuple[str, str] | None:
    """As the SDK reads a pair: the span-specific variable wins, set even to "" (= none);
    then the general one."""
    for name in names:
        if name in os.environ:
            value = os.environ[name].strip()
            return (name, value) if value else None
    return None


def _warn_limit(log: Logger, variable: str, value: object, message: str) -> None:
    """Say which span limit the saga spans are given, or are exposed to, and why."""
    with contextlib.suppress(Exception):  # a broken logging setup must not stop us
        log.warning(sc.EV_CONFIGURE_WARNING, variable=variable, value=value, message=message)


def _own_provider(log: Logger) -> TracerProvider:
    """The provider saga_otel makes when the process has none, honouring the ``OTEL_*``
    variables but an attribute value length limit and a count limit too low for saga
    spans.

    A cut value breaks the contract (the sidecar rejects an undo whose JSON arguments
    were cut; a run id cut is another run), and a provider has one limit for all its
    spans. This provider exists for the saga spans (only they are exported from it), so
    it gets none, and the log says whose limit is not applied.
    """
    resource = Resource.create()
    if sc.SERVICE_INSTANCE_ID not in resource.attributes:
        resource = resource.merge(Resource({sc.SERVICE_INSTANCE_ID: STATE.instance_id}))
    found = _length_limit_variable()
    if found is not None:
        name, value = found
        _warn_limit(
            log,
            name,
            printable(value[:40]),
            (
                f"{name}={value[:40]!r} is not applied to the tracer provider "
                "saga_otel creates: a saga span attribute value cut short is refused "
                "by the sidecar, so the undo it carries would never reach it. Spans "
                "of this provider keep their whole values; to limit your own spans, "
                "give them a provider of your own"
            ),
        )
    counted = _count_limit_variable()
    if counted is not None:
        name, value = counted
        _warn_limit(
            log,
            name,
            printable(value[:40]),
            (
                f"{name}={value[:40]!r} is not applied to the tracer provider "
                "saga_otel creates: past it the SDK drops span attributes, and a saga "
                "span without its own is refused by the sidecar. Spans of this "
                f"provider keep up to {_OWN_SPAN_ATTRIBUTES}; to limit your own spans, "
                "give them a provider of your own"
            ),
        )
    limits = SpanLimits(
        max_attribute_length=SpanLimits.UNSET,
        max_span_attribute_length=SpanLimits.UNSET,
        # None reads the variables (the SDK's default without them): only a count too
        # low for saga spans is replaced.
        max_attributes=_OWN_SPAN_ATTRIBUTES if counted is not None else None,
        max_span_attributes=_OWN_SPAN_ATTRIBUTES if counted is not None else None,
    )
    return TracerProvider(resource=resource, span_limits=limits)


def _warn_if_cut(provider: TracerProvider, log: Logger) -> None:
    """Warn when the user's provider cuts attribute values: its limit applies to the
    saga spans too (one limit per provider), and saga_otel does not change the user's.

    The sidecar rejects a span whose contract a cut breaks; saga_otel then sends a
    marker in its place (the run escalates), but the undo itself is not at the sidecar.
    """
    limits = getattr(provider, "_span_limits", None)  # the SDK keeps them private
    count = getattr(limits, "max_span_attributes", None)
    if isinstance(count, int) and count < _MIN_SPAN_ATTRIBUTES:
        found = _limit_variable(_ENV_COUNT_LIMITS)
        source = found[0] if found is not None and found[1] == str(count) else "its span_limits"
        _warn_limit(
            log,
            source,
            count,
            (
                f"the tracer provider keeps at most {count} attributes a span "
                f"({source}): a saga span has up to about 20, and one missing its own is "
                "rejected by the sidecar (saga_otel sends a marker span in its place, so "
                f"the run escalates, but the undo is lost). Raise {source} to at least "
                f"{_MIN_SPAN_ATTRIBUTES} for the provider that makes the saga spans"
            ),
        )
    limit = getattr(limits, "max_span_attribute_length", None)
    if not isinstance(limit, int):
        return
    found = _length_limit_variable()
    source = found[0] if found is not None and found[1] == str(limit) else "its span_limits"
    _warn_limit(
        log,
        source,
        limit,
        (
            f"the tracer provider cuts span attribute values to {limit} characters "
            f"({source}): a saga span whose undo arguments, stack or run id are cut "
            "is rejected by the sidecar (saga_otel sends a marker span in its place, "
            f"so the run escalates, but the undo is lost). Unset {source} for the "
            "provider that makes the saga spans, or pass configure() a tracer_provider "
            "without an attribute value length limit"
        ),
    )


def _rebrand(resource: Resource, parent_id: str) -> None:
    """In a forked child, give the resource the child's instance id if it had the parent's.

    Only for a resource that carries saga_otel's own id (an SDK without the
    process-dependent instance id detector, which renews the id itself after a
    fork). Every tracer of the provider holds this one Resource object, so
    changing it in place is the only way the child's spans (the engine's
    tracers were made before the fork) stop claiming to come from the parent.
    Resources are immutable by API, hence the private field; a resource with
    an instance id the user chose is left alone.
    """
    attrs = dict(resource.attributes)
    if attrs.get(sc.SERVICE_INSTANCE_ID) != parent_id:
        return
    attrs[sc.SERVICE_INSTANCE_ID] = STATE.instance_id
    resource._attributes = BoundedAttributes(attributes=attrs, immutable=True)


class SidecarExport:
    """What :func:`configure` set up; ``shutdown()`` stops it."""

    __slots__ = (
        "_heartbeat",
        "_shutdown_lock",
        "_stopped",
        "processor",
        "shutdown_timeout",
        "tracer_provider",
    )

    def __init__(
        self,
        tracer_provider: TracerProvider,
        processor: SagaSpanProcessor | None,
        heartbeat: Heartbeat,
        shutdown_timeout: float = 2.0,
    ) -> None:
        self.tracer_provider = tracer_provider
        self.processor = processor
        self.shutdown_timeout = shutdown_timeout
        self._heartbeat = heartbeat
        self._stopped = False
        self._shutdown_lock = threading.Lock()

    @property
    def endpoint(self) -> str | None:
        return None if self.processor is None else self.processor.endpoint

    @property
    def durable(self) -> bool:
        return self.processor is not None and self.processor.durable

    def ensure_heartbeat(self) -> None:
        if not self._stopped:
            self._heartbeat.ensure_started()

    def after_fork_in_child(self, parent_instance_id: str) -> None:
        """Restart the sender and heartbeat threads in a forked child, under its own id."""
        self._shutdown_lock = threading.Lock()
        if self._stopped:
            return
        _rebrand(self.tracer_provider.resource, parent_instance_id)
        self._heartbeat.after_fork_in_child()
        if self.processor is not None:
            self.processor.after_fork_in_child()

    def force_flush(self, timeout: float = 2.0) -> bool:
        return True if self.processor is None else self.processor.force_flush(int(timeout * 1000))

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop heartbeats and the sender, flushing pending spans, all within ``timeout``.

        ``timeout`` (seconds) defaults to ``shutdown_timeout`` (configure's,
        2 s unless set); the bound holds whatever the sidecar does.
        """
        with self._shutdown_lock:
            if self._stopped:
                return
            self._stopped = True
        budget = self.shutdown_timeout if timeout is None else max(0.0, float(timeout))
        # The heartbeat thread only ever blocks briefly (it queues a span); a
        # tenth of the budget is plenty, the rest goes to delivering spans.
        self._heartbeat.stop(timeout=budget / 10)
        if self.processor is not None:
            self.processor.shutdown(budget * 0.9)
        if STATE.active is self:
            STATE.active = None


def _at_exit() -> None:
    active = STATE.active
    if isinstance(active, SidecarExport):
        active.shutdown()


# multiprocessing ends a child it started (fork or forkserver: a Process, a Pool or
# ProcessPoolExecutor worker; billiard, Celery's fork of it, shares its registries) with
# os._exit once the child's finalizers ran: atexit never runs there, and the run-end
# span still queued was lost (the sidecar then paged a finished run orphaned). So the
# exit flush is one of its finalizers too. multiprocessing.util is imported here, not
# when the user imports multiprocessing (often later, or only in the child's bootstrap:
# too late for the after-fork callback below). Priority: before the child's other
# finalizers (a queue's feeder thread, a pool of its own), as the atexit hook runs
# before the provider's.
_EXIT_PRIORITY: Final = 100


def _exit_hooks() -> None:
    """Make the exit flush a multiprocessing finalizer of this process and of every
    child forked from it (at configure()).

    A child's bootstrap clears the finalizers it inherited (after the
    ``os.register_at_fork`` hooks ran), then runs the after-fork callbacks
    registered in its ancestors: that is where the child gets its own.
    """
    _finalize_exit()
    if not STATE.after_forker:  # inherited by the whole process tree
        STATE.after_forker = True
        multiprocessing.util.register_after_fork(STATE, _finalize_in_child)


def _finalize_exit() -> None:
    """The exit flush as a finalizer of this process, once (shutdown is idempotent: when
    it also runs at atexit, the second call does nothing)."""
    pid = os.getpid()
    if STATE.exit_finalizer_pid == pid:
        return
    STATE.exit_finalizer_pid = pid
    multiprocessing.util.Finalize(None, _at_exit, exitpriority=_EXIT_PRIORITY)


def _finalize_in_child(_state: object) -> None:
    _finalize_exit()


def configure(
    sidecar_endpoint: str | Sequence[str] | None = None,
    *,
    tracer_provider: TracerProvider | None = None,
    durable: bool | None = None,
    ack_timeout: float = 0.5,
    heartbeat_interval: float = 1.0,
    headers: Mapping[str, str] | None = None,
    registry: CollectorRegistry | None = None,
    logger: Logger | None = None,
    max_queue_size: int = 10_000,
    max_span_bytes: int = DEFAULT_MAX_SPAN_BYTES,
    request_timeout: float | None = None,
    compression: str | None = None,
    retry_initial: float = 0.1,
    retry_max: float = 5.0,
    shutdown_timeout: float = 2.0,
    presence: bool = True,
) -> SidecarExport:
    """Send this process's saga spans to the sidecar and emit heartbeats.

    The endpoint is ``sidecar_endpoint`` or ``$SAGA_OTEL_SIDECAR_ENDPOINT`` (a
    base URL gets ``/v1/traces``). Without one no processor is added (spans
    reach the sidecar through the user's own pipeline, if any) and durable
    waits return at once. Calling again replaces the previous setup.

    The processor joins ``tracer_provider``, else the global SDK provider, else a
    new one set as the global provider. A global provider that is not the SDK's
    (``NoOpTracerProvider``, a vendor's) cannot be joined nor replaced: refused
    with a :class:`ConfigurationError`. The new one applies no attribute value
    length limit (``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`` and
    ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT`` are ignored, with a warning): the
    sidecar refuses a saga span whose values were cut. A provider of yours that has
    such a limit keeps it, with a warning.

    Sidecar replicas on one database: a list of URLs (or, in the variable, URLs
    separated by commas). Requests take them in turn; one that fails is skipped
    for ``retry_max`` seconds and its unacknowledged spans go at once to the next.

    ``shutdown_timeout`` bounds what process exit (or ``shutdown()``) spends
    delivering the last spans, whatever the sidecar does: at interpreter exit, and
    when a multiprocessing child ends (a ``Process``, a ``Pool`` or
    ``ProcessPoolExecutor`` worker, which skip ``atexit``). A process that ends
    itself with ``os._exit`` skips both: call ``shutdown()`` on what ``configure()``
    returned first. A saga span larger
    than ``max_span_bytes`` once encoded is replaced by a small marker span; a
    heartbeat that would be is sent as several spans (its parts) that fit.

    The standard ``OTEL_EXPORTER_OTLP_TRACES_*`` / ``OTEL_EXPORTER_OTLP_*``
    variables apply to this export too: ``HEADERS``, ``COMPRESSION`` (``gzip``
    or ``none``), ``TIMEOUT`` (seconds for a whole request, as in the Python
    SDK; default 5) and ``CERTIFICATE`` / ``CLIENT_CERTIFICATE`` /
    ``CLIENT_KEY`` (PEM files, for https). ``headers``, ``request_timeout`` and
    ``compression`` override them.

    ``presence`` keeps one live connection to the sidecar while runs are open,
    whose close tells it at once that this process died (SIGKILL included): open
    runs are paged orphaned within about a second, not three heartbeat intervals.
    """
    log = logger if logger is not None else default_logger()
    raw = sidecar_endpoint if sidecar_endpoint is not None else os.environ.get(ENV_SIDECAR_ENDPOINT)
    # An empty variable is unset; an empty list is a mistake (resolving says so).
    endpoints = _resolve_endpoints(raw) if raw or not isinstance(raw, str | None) else ()
    endpoint = endpoints or None
    if durable is None:
        durable = endpoint is not None
    if durable and endpoint is None:
        raise ConfigurationError(
            "durable=True needs a sidecar endpoint: pass sidecar_endpoint= or set "
            f"{ENV_SIDECAR_ENDPOINT} (e.g. http://127.0.0.1:4318), or leave durable unset"
        )
    if heartbeat_interval <= 0:
        raise ConfigurationError(
            f"heartbeat_interval={heartbeat_interval!r} must be > 0 seconds (default 1.0)"
        )
    if shutdown_timeout <= 0:
        raise ConfigurationError(
            f"shutdown_timeout={shutdown_timeout!r} must be > 0 seconds (default 2.0)"
        )

    if tracer_provider is not None:
        if not isinstance(tracer_provider, TracerProvider):
            raise ConfigurationError(
                f"tracer_provider {tracer_provider!r} is not an OpenTelemetry SDK "
                "TracerProvider; pass opentelemetry.sdk.trace.TracerProvider or None"
            )
        provider = tracer_provider
        _warn_if_cut(provider, log)
    else:
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            provider = current  # the user's: we only add our processor to it
            _warn_if_cut(provider, log)
        elif isinstance(current, trace.ProxyTracerProvider):  # none set yet: ours becomes it
            provider = _own_provider(log)
            trace.set_tracer_provider(provider)
        else:
            # OpenTelemetry refuses to replace a global provider once set (it only logs a
            # warning): ours would take spans nobody creates, and the sidecar gets nothing.
            kind = type(current)
            raise ConfigurationError(
                f"the global tracer provider is {kind.__module__}.{kind.__qualname__}, not "
                "an OpenTelemetry SDK TracerProvider, and cannot be replaced, so configure() "
                "would export nothing: pass tracer_provider= an "
                "opentelemetry.sdk.trace.TracerProvider (and use it for your spans), or call "
                "configure() before anything sets a global tracer provider"
            )

    processor: SagaSpanProcessor | None = None
    processor_transport = _transport(headers, request_timeout, compression)
    if endpoint is not None:
        processor = SagaSpanProcessor(
            endpoints,
            durable=durable,
            ack_timeout=ack_timeout,
            transport=processor_transport,
            registry=registry,
            logger=log,
            max_queue_size=max_queue_size,
            max_span_bytes=max_span_bytes,
            retry_initial=retry_initial,
            retry_max=retry_max,
            shutdown_timeout=shutdown_timeout,
        )

    with STATE.configure_lock:
        previous = STATE.active
        if isinstance(previous, SidecarExport):
            previous.shutdown()
        if processor is not None:
            provider.add_span_processor(processor)
        export = SidecarExport(
            provider,
            processor,
            Heartbeat(
                provider,
                heartbeat_interval,
                log,
                presence=(
                    Presence(processor.endpoints, processor_transport, instance_id, log)
                    if processor is not None and presence
                    else None
                ),
                registry=registry,
                max_span_bytes=max_span_bytes,
            ),
            shutdown_timeout=shutdown_timeout,
        )
        STATE.active = export
        if not STATE.atexit_registered:
            # Registered after the provider's own exit hook, so it runs first
            # (atexit is last-in, first-out) and the bound is ours.
            atexit.register(_at_exit)
            STATE.atexit_registered = True
        _exit_hooks()
    if open_run_ids():
        export.ensure_heartbeat()
    return export
