"""OTLP trace decoding: protobuf or JSON bodies in, validated SpanRecords out.

Everything the sidecar reads from the wire goes through here, so this is where
a malformed request becomes a 400 and a malformed saga span becomes a rejected
span (partial success), never an exception further in.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError as ProtobufDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from saga_otel import semconv as sc
from saga_otel.contract import check

from . import _jsontext as jsontext
from ._errors import DecodeError

_STATUS_CODE_ERROR = 2
MAX_ERROR_MESSAGES = 5


@dataclass(frozen=True, slots=True)
class SpanEvent:
    name: str
    time: float
    attributes: Mapping[str, Any]


class _SpanFields(NamedTuple):
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start: float
    end: float
    status: str  # "ok", "error" or "unset" (unset counts as ok, as OpenTelemetry does)
    status_message: str
    attributes: Mapping[str, Any]
    resource: Mapping[str, Any]
    events: tuple[SpanEvent, ...]
    # Of the resource, read once: the intake asks for them several times a span.
    instance: str
    service: str


class SpanRecord(_SpanFields):
    """One span as the state machine sees it. Ids are lowercase hex; times epoch seconds.

    A named tuple (the intake builds one per span: a tuple costs a fifth of a frozen
    dataclass's field-by-field init); ``instance`` and ``service`` come from ``resource``.
    """

    __slots__ = ()

    def __new__(
        cls,
        trace_id: str,
        span_id: str,
        parent_span_id: str,
        name: str,
        start: float,
        end: float,
        status: str,
        status_message: str,
        attributes: Mapping[str, Any],
        resource: Mapping[str, Any],
        events: tuple[SpanEvent, ...] = (),
    ) -> SpanRecord:
        return _new_record(
            cls,
            (
                trace_id,
                span_id,
                parent_span_id,
                name,
                start,
                end,
                status,
                status_message,
                attributes,
                resource,
                events,
                str(resource.get(sc.SERVICE_INSTANCE_ID, "")),
                str(resource.get(sc.SERVICE_NAME, "")),
            ),
        )

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy and pickle: the constructor's
        return tuple(self)[:11]

    @property
    def ok(self) -> bool:
        return self.status != "error"

    @property
    def phase(self) -> str:
        return str(self.attributes.get(sc.SAGA_PHASE, ""))

    @property
    def run_id(self) -> str:
        return str(self.attributes.get(sc.SAGA_RUN_ID, ""))


_new_record = tuple.__new__


@dataclass(frozen=True, slots=True)
class Decoded:
    """One request's spans. ``raw[i]`` is the serialized protobuf Span of ``spans[i]``."""

    spans: tuple[SpanRecord, ...]
    raw: tuple[bytes, ...]
    total: int
    ignored: int
    rejected: int
    errors: tuple[str, ...]
    # Accepted with a caveat (OTLP partial success with 0 rejected): e.g. a derived instance.
    warnings: tuple[str, ...] = ()

    @property
    def error_message(self) -> str:
        parts = list(self.warnings)
        if self.rejected:
            parts.insert(0, f"{self.rejected} saga span(s) rejected: " + "; ".join(self.errors))
        return "; ".join(parts)


# --- instance identity ------------------------------------------------------------
# A stream without service.instance.id (the OpenTelemetry JS SDK sets none) still needs
# one: the orphan watch, run ownership and heartbeats are all per instance. The sidecar
# derives it from the resource, which an SDK builds once per process: every attribute
# goes into a digest, so two processes whose resources differ in anything (pid, host,
# start time, the SDK's own ids) get two instances. A resource that names no process
# (no process.pid or process.creation.time) and no host cannot tell two processes of one
# service apart: then each trace (each run) is its own instance, so a run is never tied
# to another process's heartbeats (it is orphaned by the idle timeout instead).

_PROCESS_KEYS = (sc.PROCESS_PID, sc.PROCESS_CREATION_TIME)
_HOST_KEYS = (sc.HOST_ID, sc.HOST_NAME, sc.CONTAINER_ID, sc.K8S_POD_UID)
DERIVED_PREFIX = "derived:"


@dataclass(frozen=True, slots=True)
class DerivedInstance:
    """The instance given to a resource without ``service.instance.id``."""

    instance: str
    per_trace: bool  # nothing in the resource tells processes apart
    warning: str

    def for_trace(self, trace_id: str) -> str:
        return f"{self.instance}/trace:{trace_id}" if self.per_trace else self.instance


def derive_instance(resource: Mapping[str, Any]) -> DerivedInstance:
    """The instance of a resource that carries no ``service.instance.id``, and the warning.

    Pure and stable (a restarted sidecar derives the same id): ``derived:`` + host +
    pid + a digest of every resource attribute.
    """
    items = sorted((k, v) for k, v in resource.items() if k != sc.SERVICE_INSTANCE_ID)
    text = json.dumps(items, default=repr, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    host = next((str(resource[k]) for k in _HOST_KEYS if resource.get(k)), "")
    pid = resource.get(sc.PROCESS_PID)
    parts = [p for p in (host, str(pid) if pid is not None else "") if p]
    instance = DERIVED_PREFIX + ":".join([*parts, digest])
    per_trace = not any(resource.get(k) is not None for k in _PROCESS_KEYS) or not host
    service = resource.get(sc.SERVICE_NAME) or "?"
    fix = (
        f"set {sc.SERVICE_INSTANCE_ID} on the resource, unique per process (e.g. "
        f"OTEL_RESOURCE_ATTRIBUTES={sc.SERVICE_INSTANCE_ID}=<a new UUID per process start>)"
    )
    if per_trace:
        warning = (
            f"service {service!s}: no {sc.SERVICE_INSTANCE_ID} on the resource, and nothing "
            f"there tells one process from another (need {' or '.join(_PROCESS_KEYS)} and "
            f"one of {', '.join(_HOST_KEYS)}): each run is its own instance "
            f"{instance}/trace:<trace id> and heartbeats cannot keep it alive; {fix}"
        )
    else:
        used = ", ".join(k for k in (*_HOST_KEYS, *_PROCESS_KEYS) if k in resource)
        warning = (
            f"service {service!s}: no {sc.SERVICE_INSTANCE_ID} on the resource; the sidecar "
            f"derived {instance!r} from {used} and the other resource attributes; {fix}"
        )
    return DerivedInstance(instance, per_trace, warning)


# --- attribute values ---------------------------------------------------------


def any_value(value: Any) -> Any:
    """An OTLP AnyValue as a plain Python value."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return value.int_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "double_value":
        return value.double_value
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return bytes(value.bytes_value)
    return None


_SCALARS = frozenset({"string_value", "int_value", "bool_value", "double_value"})


def _attributes(kvs: Iterable[Any]) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        value = kv.value
        kind = value.WhichOneof("value")
        # Inline fast path: almost every attribute is a scalar.
        out[kv.key] = getattr(value, kind) if kind in _SCALARS else any_value(value)
    return out


# --- lean reading ---------------------------------------------------------------
# The generated OTLP types make a Python object per attribute (KeyValue, AnyValue)
# before we can even see a key: most of the cost of a batch. These message types
# read the same wire format with the attributes as a map of key -> AnyValue bytes
# (a map entry and a KeyValue are the same bytes), so a span without saga.phase
# costs one lookup, and with RawScopeSpans every Span comes out as its own bytes.

_F = descriptor_pb2.FieldDescriptorProto


def _lean_types() -> tuple[Any, Any, Any]:
    fdp = descriptor_pb2.FileDescriptorProto(
        name="saga_sidecar_lean.proto", package="saga_sidecar_lean", syntax="proto3"
    )
    rep, opt = _F.LABEL_REPEATED, _F.LABEL_OPTIONAL

    def message(name: str, fields: Iterable[tuple[str, int, Any, Any, str]]) -> Any:
        m = fdp.message_type.add(name=name)
        for fname, number, kind, label, type_name in fields:
            field = m.field.add(name=fname, number=number, type=kind, label=label)
            if type_name:
                field.type_name = f".saga_sidecar_lean.{type_name}"
        return m

    def attributes(m: Any, number: int) -> None:
        entry = m.nested_type.add(name="AttributesEntry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=opt)
        entry.field.add(name="value", number=2, type=_F.TYPE_BYTES, label=opt)
        m.field.add(
            name="attributes",
            number=number,
            type=_F.TYPE_MESSAGE,
            label=rep,
            type_name=f".saga_sidecar_lean.{m.name}.AttributesEntry",
        )

    msg = _F.TYPE_MESSAGE
    message("Request", [("resource_spans", 1, msg, rep, "ResourceSpans")])
    message(
        "ResourceSpans",
        [("resource", 1, msg, opt, "Resource"), ("scope_spans", 2, msg, rep, "ScopeSpans")],
    )
    attributes(message("Resource", []), 1)
    message("ScopeSpans", [("spans", 2, msg, rep, "Span")])
    message(
        "Span",
        [
            ("trace_id", 1, _F.TYPE_BYTES, opt, ""),
            ("span_id", 2, _F.TYPE_BYTES, opt, ""),
            ("parent_span_id", 4, _F.TYPE_BYTES, opt, ""),
            ("name", 5, _F.TYPE_STRING, opt, ""),
            ("start_time_unix_nano", 7, _F.TYPE_FIXED64, opt, ""),
            ("end_time_unix_nano", 8, _F.TYPE_FIXED64, opt, ""),
            ("events", 11, _F.TYPE_BYTES, rep, ""),
            ("status", 15, msg, opt, "Status"),
            # Each KeyValue as its bytes: most are the same bytes span after span (the
            # phase, the saga and step names, the attempt), read once (see _entry).
            ("attributes", 9, _F.TYPE_BYTES, rep, ""),
        ],
    )
    message(
        "Status", [("message", 2, _F.TYPE_STRING, opt, ""), ("code", 3, _F.TYPE_INT32, opt, "")]
    )
    message("RawRequest", [("resource_spans", 1, msg, rep, "RawResourceSpans")])
    message(
        "RawResourceSpans",
        [("resource", 1, _F.TYPE_BYTES, opt, ""), ("scope_spans", 2, msg, rep, "RawScopeSpans")],
    )
    message("RawScopeSpans", [("spans", 2, _F.TYPE_BYTES, rep, "")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return tuple(  # type: ignore[return-value]
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"saga_sidecar_lean.{n}"))
        for n in ("Span", "Resource", "RawRequest")
    )


# A request is read as RawRequest (each Resource and Span as its bytes); a saga span's
# bytes, and a resource not seen before, are then read through the lean types: no
# wrapper is built for a non-saga span, a scope, or a resource already known.
_LeanSpan, _LeanResource, _RawRequest = _lean_types()
_DOUBLE = struct.Struct("<d")


def _value(data: bytes) -> Any:
    """``any_value`` of a serialized AnyValue; the usual one-field shapes without parsing."""
    size = len(data)
    if size >= 2:
        tag = data[0]
        if tag == 0x0A:  # string_value; one- or two-byte length, nothing after it
            n = data[1]
            if n < 0x80:
                if size == n + 2:
                    return data[2:].decode()
            elif size >= 3 and data[2] < 0x80 and size == (n & 0x7F | data[2] << 7) + 3:
                return data[3:].decode()
        elif tag == 0x18:  # int_value, 0..127
            if size == 2 and data[1] < 0x80:
                return data[1]
        elif tag == 0x10:  # bool_value
            if size == 2 and data[1] < 2:
                return data[1] == 1
        elif tag == 0x21 and size == 9:  # double_value
            return _DOUBLE.unpack_from(data, 1)[0]
    return any_value(AnyValue.FromString(data))


def _entry(data: bytes) -> tuple[str, Any]:
    """A serialized KeyValue as (key, value); the usual short shape without parsing."""
    size = len(data)
    # key: tag 0x0A, a one-byte length; value: tag 0x12, a one- or two-byte length.
    if size >= 4 and data[0] == 0x0A and data[1] < 0x80:
        at = data[1] + 2
        if at < size and data[at] == 0x12:
            n = data[at + 1] if at + 1 < size else 0x80
            if n < 0x80:
                start = at + 2
            elif at + 2 < size and data[at + 2] < 0x80:
                n, start = n & 0x7F | data[at + 2] << 7, at + 3
            else:
                start = size + 1
            if start + n == size:
                return data[2:at].decode(), _value(data[start:])
    kv = KeyValue.FromString(data)
    return kv.key, any_value(kv.value)


# Attributes whose KeyValue bytes repeat across spans (names, phases, attempts, the
# contract version): their (key, value) is read once and shared, so a run's step names,
# tools and descriptions are one string each across runs. Bounded: cleared when full.
_SHARED_KEYS = frozenset(
    {
        sc.SAGA_PHASE,
        sc.SAGA_NAME,
        sc.SAGA_CONTRACT_VERSION,
        sc.SAGA_STEP_NAME,
        sc.SAGA_STEP_INDEX,
        sc.SAGA_STEP_ATTEMPT,
        sc.SAGA_STEP_CLASS,
        sc.SAGA_STEP_PIVOT,
        sc.SAGA_COMPENSATION_TOOL,
        sc.SAGA_COMPENSATION_DESCRIPTION,
        sc.SAGA_RUN_STATUS,
        sc.SAGA_RUN_FAILED_STEP,
    }
)
_ENTRY_CACHE_MAX = 4096
_entries: dict[bytes, tuple[str, Any]] = {}
_IMMUTABLE = (str, int, float)  # bool is an int


def _read_entry(data: bytes) -> tuple[str, Any]:
    """:func:`_entry`, remembered for the attributes of :data:`_SHARED_KEYS`."""
    entry = _entry(data)
    if entry[0] in _SHARED_KEYS and isinstance(entry[1], _IMMUTABLE):
        if len(_entries) >= _ENTRY_CACHE_MAX:
            _entries.clear()
        _entries[data] = entry
    return entry


# --- validation -----------------------------------------------------------------


# JSON text the sidecar parses again later (arguments, the escalation card): nested
# past jsontext.MAX_DEPTH it is hostile, and rejected here rather than walked later.
_NESTED_JSON = (sc.SAGA_COMPENSATION_ARGS, sc.SAGA_ESCALATION_CARD)


def validate(attrs: Mapping[str, Any]) -> str | None:
    """Why a span that carries ``saga.phase`` breaks the contract, or None when it does not.

    The rules are ``saga_otel.contract`` (shared with ``saga_otel.testing``); a
    rejected span's partial-success message names its first problem. The sidecar
    adds one bound of its own: JSON attributes nest at most ``jsontext.MAX_DEPTH``.
    The run id rule is the intake's next step (``_server._screen``), which refuses
    a bad id as ``bad_run_id``, its own metric reason, so it is left out here.
    """
    problems = check(attrs, run_id_rule=False)
    if problems:
        return str(problems[0])
    for key in _NESTED_JSON:
        text = attrs.get(key)
        if not isinstance(text, str):
            continue
        if not jsontext.may_nest_past(text):
            continue  # no second parse needed
        try:
            jsontext.loads(text)
        except jsontext.TooDeep:
            return f"{key} is JSON nested deeper than {jsontext.MAX_DEPTH} levels: flatten it"
        except ValueError:
            continue  # not JSON: the contract says where that matters
    return None


# --- requests -------------------------------------------------------------------


def parse_protobuf(body: bytes) -> ExportTraceServiceRequest:
    try:
        return ExportTraceServiceRequest.FromString(body)
    except (ProtobufDecodeError, ValueError, RuntimeError) as exc:
        raise DecodeError(
            f"body is not an OTLP ExportTraceServiceRequest protobuf ({exc}): send "
            "application/x-protobuf encoded by an OpenTelemetry exporter"
        ) from exc


def _hex_to_b64(value: Any, what: str) -> Any:
    if not isinstance(value, str) or not value:
        return value
    try:
        return base64.b64encode(bytes.fromhex(value)).decode()
    except ValueError as exc:
        raise DecodeError(f"{what} {value[:40]!r} is not hex: OTLP/JSON ids are hex") from exc


OTLP_JSON_MAX_DEPTH = 128


def parse_json(body: bytes) -> ExportTraceServiceRequest:
    """OTLP/JSON: the protobuf JSON mapping, except ids are hex (not base64)."""
    try:
        # protobuf's own recursion limit is 100 messages; a span's JSON is ~2 levels each.
        data = jsontext.loads(body, OTLP_JSON_MAX_DEPTH)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DecodeError(f"body is not JSON ({exc}): send OTLP/JSON or protobuf") from exc
    if not isinstance(data, dict):
        raise DecodeError(
            f"OTLP/JSON body must be an object with resourceSpans, got {type(data).__name__}"
        )
    try:
        for rs in _list(data.get("resourceSpans", data.get("resource_spans"))):
            for ss in _list(_get(rs, "scopeSpans", "scope_spans")):
                for span in _list(_get(ss, "spans", "spans")):
                    if not isinstance(span, dict):
                        continue
                    for camel, snake in (
                        ("traceId", "trace_id"),
                        ("spanId", "span_id"),
                        ("parentSpanId", "parent_span_id"),
                    ):
                        for key in (camel, snake):
                            if key in span:
                                span[key] = _hex_to_b64(span[key], key)
                    for link in _list(span.get("links")):
                        if isinstance(link, dict):
                            for key in ("traceId", "spanId"):
                                if key in link:
                                    link[key] = _hex_to_b64(link[key], key)
        return json_format.ParseDict(data, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except DecodeError:
        raise
    except (json_format.ParseError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise DecodeError(f"OTLP/JSON body has the wrong shape: {exc}") from exc


def _get(obj: Any, camel: str, snake: str) -> Any:
    if not isinstance(obj, dict):
        return None
    return obj.get(camel, obj.get(snake))


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def extract(request: ExportTraceServiceRequest, body: bytes | None = None) -> Decoded:
    """Walk a request: saga spans out, non-saga spans counted, bad saga spans rejected.

    ``body`` is the protobuf the request was parsed from, when there is one (it
    saves serialising the request again). The full parse of ``request`` is still
    what decides that a body is well formed; this reads the same bytes again
    through the lean message types below.
    """
    if body is None:
        body = request.SerializeToString()
    try:
        raw = _RawRequest.FromString(body)
    except (ProtobufDecodeError, ValueError, RuntimeError):
        return _extract_exact(request)  # cannot happen for a body that parsed; never guess
    parse_span = _LeanSpan.FromString
    spans: list[SpanRecord] = []
    raws: list[bytes] = []
    errors: list[str] = []
    warnings: list[str] = []
    total = ignored = rejected = 0
    phase_key = sc.SAGA_PHASE
    phase_bytes = phase_key.encode()
    known = _entries.get
    for raw_rs in raw.resource_spans:
        resource: dict[str, Any] | None = None
        derived: DerivedInstance | None = None
        for raw_ss in raw_rs.scope_spans:
            for data in raw_ss.spans:
                total += 1
                if phase_bytes not in data:
                    ignored += 1  # not a saga span: counted, never decoded or stored
                    continue
                try:
                    span = parse_span(data)
                except (ProtobufDecodeError, ValueError, RuntimeError):
                    return _extract_exact(request)  # as above: cannot happen; never guess
                try:
                    # Wire order, the last of a key wins: as _attributes (the exact path).
                    attrs = dict([known(kv) or _read_entry(kv) for kv in span.attributes])
                except RecursionError:
                    attrs = {phase_key: None}  # decided the exact way below
                if phase_key not in attrs:
                    ignored += 1  # "saga.phase" was elsewhere in the span (an event, a value)
                    continue
                try:
                    problem = validate(attrs)
                except RecursionError:
                    problem = ""
                if problem is not None:
                    # Rare: redo the span the exact way, so the message is the exact
                    # path's (and a value nested too deeply gets its own).
                    problem = _problem_exact(PbSpan.FromString(data))
                trace_id, span_id = span.trace_id, span.span_id
                if problem is None and (len(trace_id) != 16 or len(span_id) != 8):
                    problem = (
                        f"span ids have the wrong length (trace {len(trace_id)} bytes, "
                        f"span {len(span_id)} bytes): use 16 and 8 bytes"
                    )
                if problem is not None:
                    rejected += 1
                    if len(errors) < MAX_ERROR_MESSAGES and problem not in errors:
                        errors.append(problem)
                    continue
                if resource is None:
                    resource, derived = _resource(raw_rs.resource, warnings)
                events = span.events
                spans.append(
                    _record(
                        span,
                        attrs,
                        resource
                        if derived is None
                        else _span_resource(resource, derived, trace_id, attrs),
                        _events(events) if events else (),
                        trace_id,
                        span_id,
                    )
                )
                raws.append(data)  # the Span exactly as received: nothing to serialise
    return Decoded(
        tuple(spans), tuple(raws), total, ignored, rejected, tuple(errors), tuple(warnings)
    )


# A process sends the same resource with every request: its bytes -> its decoded dict
# (read-only from here on) and derived instance. Bounded: cleared when full.
_RESOURCE_CACHE_MAX = 1024
_resources: dict[bytes, tuple[dict[str, Any], DerivedInstance | None]] = {}


def _resource(data: bytes, warnings: list[str]) -> tuple[dict[str, Any], DerivedInstance | None]:
    """A Resource's attributes from its bytes (``data``; parsed when not seen before)."""
    found = _resources.get(data)
    if found is None:
        wire = _LeanResource.FromString(data).attributes
        resource = {k: _value(wire[k]) for k in wire}
        found = (resource, _identify(resource, []))
        if len(_resources) >= _RESOURCE_CACHE_MAX:
            _resources.clear()
        _resources[data] = found
    derived = found[1]
    # Each request carries the warning, as _identify gives it.
    warning = derived.warning if derived is not None else None
    if warning is not None and len(warnings) < MAX_ERROR_MESSAGES and warning not in warnings:
        warnings.append(warning)
    return found


def _identify(resource: dict[str, Any], warnings: list[str]) -> DerivedInstance | None:
    """Give a resource without ``service.instance.id`` its derived one (and say so)."""
    if resource.get(sc.SERVICE_INSTANCE_ID):
        return None
    derived = derive_instance(resource)
    resource[sc.SERVICE_INSTANCE_ID] = derived.instance
    if len(warnings) < MAX_ERROR_MESSAGES and derived.warning not in warnings:
        warnings.append(derived.warning)
    return derived


def _span_resource(
    resource: dict[str, Any], derived: DerivedInstance | None, trace_id: bytes, attrs: Any
) -> dict[str, Any]:
    if derived is None or not derived.per_trace or attrs.get(sc.SAGA_PHASE) == sc.PHASE_HEARTBEAT:
        return resource
    return {**resource, sc.SERVICE_INSTANCE_ID: derived.for_trace(trace_id.hex())}


def _record(
    span: Any,
    attrs: dict[str, Any],
    resource: Any,
    events: tuple[SpanEvent, ...],
    trace_id: bytes | None = None,
    span_id: bytes | None = None,
) -> SpanRecord:
    """One SpanRecord from a decoded Span (the fast and the exact path alike)."""
    status = span.status
    code = status.code
    return SpanRecord(
        (span.trace_id if trace_id is None else trace_id).hex(),
        (span.span_id if span_id is None else span_id).hex(),
        span.parent_span_id.hex(),
        span.name,
        span.start_time_unix_nano / 1e9,
        span.end_time_unix_nano / 1e9,
        "error" if code == _STATUS_CODE_ERROR else ("ok" if code == 1 else "unset"),
        status.message,
        attrs,
        resource,
        events,
    )


def _events(events: Iterable[bytes]) -> tuple[SpanEvent, ...]:
    out = []
    for data in events:
        e = PbSpan.Event.FromString(data)
        out.append(SpanEvent(e.name, e.time_unix_nano / 1e9, _attributes(e.attributes)))
    return tuple(out)


def _problem_exact(span: Any) -> str | None:
    """``validate`` on attributes decoded in wire order, as :func:`_extract_exact` does."""
    try:
        attrs = _attributes(span.attributes)
    except RecursionError:
        attrs = {sc.SAGA_PHASE: None}
    try:
        return validate(attrs)
    except RecursionError:
        return "attribute values nest too deeply"


def _extract_exact(request: ExportTraceServiceRequest) -> Decoded:
    """:func:`extract` through the generated message types only (the fallback)."""
    spans: list[SpanRecord] = []
    raw: list[bytes] = []
    errors: list[str] = []
    warnings: list[str] = []
    total = ignored = rejected = 0
    phase_key = sc.SAGA_PHASE
    for rs in request.resource_spans:
        resource: dict[str, Any] | None = None
        derived: DerivedInstance | None = None
        for ss in rs.scope_spans:
            for span in ss.spans:
                total += 1
                try:
                    attrs = _attributes(span.attributes)
                except RecursionError:
                    attrs = {phase_key: None}
                if phase_key not in attrs:
                    ignored += 1  # not a saga span: counted, never validated or stored
                    continue
                if resource is None:
                    resource = _attributes(rs.resource.attributes)
                    derived = _identify(resource, warnings)
                try:
                    problem = validate(attrs)
                    if problem is None and (len(span.trace_id) != 16 or len(span.span_id) != 8):
                        problem = (
                            f"span ids have the wrong length (trace {len(span.trace_id)} bytes, "
                            f"span {len(span.span_id)} bytes): use 16 and 8 bytes"
                        )
                except RecursionError:
                    problem = "attribute values nest too deeply"
                if problem is not None:
                    rejected += 1
                    if len(errors) < MAX_ERROR_MESSAGES and problem not in errors:
                        errors.append(problem)
                    continue
                events = tuple(
                    SpanEvent(e.name, e.time_unix_nano / 1e9, _attributes(e.attributes))
                    for e in span.events
                )
                spans.append(
                    _record(
                        span, attrs, _span_resource(resource, derived, span.trace_id, attrs), events
                    )
                )
                raw.append(span.SerializeToString())
    return Decoded(
        tuple(spans), tuple(raw), total, ignored, rejected, tuple(errors), tuple(warnings)
    )


def span_from_stored(raw: bytes, service: str, instance: str) -> SpanRecord:
    """Rebuild a SpanRecord from what the store keeps (the Span bytes and two resource keys)."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    for key, value in ((sc.SERVICE_NAME, service), (sc.SERVICE_INSTANCE_ID, instance)):
        if value:
            kv = rs.resource.attributes.add()
            kv.key = key
            kv.value.string_value = value
    rs.scope_spans.add().spans.add().MergeFromString(raw)
    decoded = extract(request)
    if not decoded.spans:
        raise DecodeError(f"stored span no longer validates: {decoded.error_message}")
    return decoded.spans[0]


def _rpc_types() -> tuple[Any, Any]:
    """google.rpc.Status and RetryInfo as private types of the same wire format (an Any
    is its type URL and bytes): googleapis-common-protos is no dependency of the sidecar."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name="saga_sidecar_rpc.proto", package="saga_sidecar_rpc", syntax="proto3"
    )
    opt, rep = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
    shapes: dict[str, list[tuple[str, int, Any, Any, str]]] = {
        "Status": [
            ("code", 1, _F.TYPE_INT32, opt, ""),
            ("message", 2, _F.TYPE_STRING, opt, ""),
            ("details", 3, _F.TYPE_MESSAGE, rep, "Any"),
        ],
        "Any": [("type_url", 1, _F.TYPE_STRING, opt, ""), ("value", 2, _F.TYPE_BYTES, opt, "")],
        "RetryInfo": [("retry_delay", 1, _F.TYPE_MESSAGE, opt, "Duration")],
        "Duration": [("seconds", 1, _F.TYPE_INT64, opt, ""), ("nanos", 2, _F.TYPE_INT32, opt, "")],
    }
    for name, fields in shapes.items():
        m = fdp.message_type.add(name=name)
        for fname, number, kind, label, type_name in fields:
            field = m.field.add(name=fname, number=number, type=kind, label=label)
            if type_name:
                field.type_name = f".saga_sidecar_rpc.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return tuple(  # type: ignore[return-value]
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"saga_sidecar_rpc.{n}"))
        for n in ("Status", "RetryInfo")
    )


_RpcStatus, _RetryInfo = _rpc_types()
RETRY_INFO_URL = "type.googleapis.com/google.rpc.RetryInfo"


def rpc_status(code: int, message: str, retry_after: int | None = None) -> bytes:
    """A serialized google.rpc.Status: an OTLP/HTTP error body, gRPC's
    ``grpc-status-details-bin``. With ``retry_after`` (seconds) it carries a
    google.rpc.RetryInfo, gRPC's Retry-After: the delay an OTLP exporter waits before
    it sends again."""
    status = _RpcStatus(code=code, message=message)
    if retry_after is not None:
        info = _RetryInfo()
        info.retry_delay.seconds = retry_after
        status.details.add(type_url=RETRY_INFO_URL, value=info.SerializeToString())
    return bytes(status.SerializeToString())


def response(rejected: int, message: str, as_json: bool) -> tuple[bytes, str]:
    """The ExportTraceServiceResponse body and content type for a request's encoding."""
    if not (rejected or message):  # the usual answer: built once
        return _ACCEPTED_JSON if as_json else _ACCEPTED_PROTOBUF
    if as_json:
        body: dict[str, Any] = {}
        if rejected or message:
            body["partialSuccess"] = {"rejectedSpans": rejected, "errorMessage": message}
        return json.dumps(body).encode(), "application/json"
    resp = ExportTraceServiceResponse()
    if rejected or message:
        resp.partial_success.CopyFrom(
            ExportTracePartialSuccess(rejected_spans=rejected, error_message=message)
        )
    return resp.SerializeToString(), "application/x-protobuf"


_ACCEPTED_JSON = (b"{}", "application/json")
_ACCEPTED_PROTOBUF = (ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")


# An SDK pointed at the sidecar with OTEL_EXPORTER_OTLP_ENDPOINT sends its logs and
# metrics here too: refused saying so (a 404, gRPC UNIMPLEMENTED: never retried, so no
# storm), not a bare "Not Found". Paths as OTLP/HTTP names them.
OTHER_SIGNALS: Final[dict[str, str]] = {"/v1/logs": "logs", "/v1/metrics": "metrics"}


def other_signal(signal: str, where: str) -> str:
    """Why ``signal`` sent to ``where`` is refused, and the two ways to stop sending it."""
    var = signal.upper()
    return (
        f"the sidecar takes traces only, not {signal} ({where}): point this SDK's {signal} "
        f"exporter elsewhere (OTEL_EXPORTER_OTLP_{var}_ENDPOINT) or turn it off "
        f"(OTEL_{var}_EXPORTER=none), and send traces to /v1/traces"
    )
