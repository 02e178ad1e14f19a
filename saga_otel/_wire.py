"""OTLP/protobuf bytes of finished spans, written straight to the wire format.

The durable step waits for its span's round trip, and encoding one span through
the SDK's encoder (a protobuf object per attribute, the resource re-encoded and
hashed through JSON for every request) took ~70 µs of it. This writes the same
bytes directly: the resource and scope parts are encoded once and kept, the span
fields in field-number order with proto3 defaults left out, as protobuf's own
serializer does. ``tests/saga_otel/test_wire.py`` holds it to byte equality with
``encode_spans(...).SerializeToString()`` over generated spans.

Anything this does not expect (an attribute value of another type, a mapping)
makes :func:`encode` fall back to the SDK's encoder for that request.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext

__all__ = ["encode", "string_item_bytes"]

_KINDS: Final = (1, 2, 3, 4, 5)  # SpanKind.value 0..4 -> SPAN_KIND_INTERNAL..CONSUMER
_HAS_IS_REMOTE: Final = 0x100
_IS_REMOTE: Final = 0x200
_CACHE_MAX: Final = 64
_KEYS_MAX: Final = 4096
_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_pack_fixed32 = struct.Struct("<I").pack


# Caches below: safe to share between sender threads (a lost race only re-encodes).
_keys: dict[str, bytes] = {}


class _Unusual(Exception):
    """A value this encoder leaves to the SDK's."""


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64: two's complement, ten bytes
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (tag already shifted, wire type 2)."""
    n = len(payload)
    return (bytes((tag, n)) if n < 0x80 else bytes((tag,)) + _varint(n)) + payload


def _text(tag: int, s: str) -> bytes:
    return _ld(tag, s.encode("utf-8"))


def _any(value: object) -> bytes:
    """AnyValue's bytes for one attribute value."""
    if value.__class__ is str:
        return _text(0x0A, value)
    if value.__class__ is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if value.__class__ is int:
        if not -(1 << 63) <= value < 1 << 63:
            raise _Unusual("int64 range")  # the SDK logs and skips it
        return b"\x18" + _varint(value)
    if value.__class__ is float:
        return b"\x21" + _pack_double(value)
    if isinstance(value, (tuple, list)):
        return _ld(0x2A, b"".join([_ld(0x0A, _any(v)) for v in value]))
    raise _Unusual(type(value).__name__)


def _key_head(key: str) -> bytes:
    """KeyValue's key field, kept per key: a process repeats a few dozen keys."""
    head = _keys.get(key)
    if head is None:
        if key.__class__ is not str:  # the SDK's cleaning keeps str keys only; be sure
            raise _Unusual("key")
        head = _text(0x0A, key)
        if len(_keys) >= _KEYS_MAX:
            _keys.clear()
        _keys[key] = head
    return head


def _attributes(tag: int, attributes: object) -> bytes:
    if not attributes:
        return b""
    out = []
    for key, value in attributes.items():  # type: ignore[attr-defined]
        if value.__class__ is str:  # the common case, inline
            vb = value.encode("utf-8")
            n = len(vb)
            any_ = (bytes((0x0A, n)) if n < 0x80 else b"\x0a" + _varint(n)) + vb
        else:
            any_ = _any(value)
        m = len(any_)
        kv = _key_head(key) + (bytes((0x12, m)) if m < 0x80 else b"\x12" + _varint(m)) + any_
        k = len(kv)
        out.append((bytes((tag, k)) if k < 0x80 else bytes((tag,)) + _varint(k)) + kv)
    return b"".join(out)


def _count(tag: int, n: int) -> bytes:
    return bytes((tag,)) + _varint(n) if n else b""


def _flags(parent: SpanContext | None) -> int:
    return (
        _HAS_IS_REMOTE | _IS_REMOTE if parent is not None and parent.is_remote else _HAS_IS_REMOTE
    )


def _span(span: ReadableSpan) -> bytes:
    ctx = span.get_span_context()
    if ctx is None:
        raise _Unusual("context")
    parts = [
        b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + ctx.span_id.to_bytes(8, "big"),
    ]
    state = ctx.trace_state
    if state is not None:
        text = ",".join([f"{k}={v}" for k, v in state.items()])
        if text:
            parts.append(_text(0x1A, text))
    parent = span.parent
    if parent:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    if span.name:
        parts.append(_text(0x2A, span.name))
    parts.append(bytes((0x30, _KINDS[span.kind.value])))
    if span.start_time:
        parts.append(b"\x39" + _pack_fixed64(span.start_time))
    if span.end_time:
        parts.append(b"\x41" + _pack_fixed64(span.end_time))
    parts.append(_attributes(0x4A, span.attributes))
    parts.append(_count(0x50, span.dropped_attributes))
    for event in span.events:
        body = b""
        if event.timestamp:
            body += b"\x09" + _pack_fixed64(event.timestamp)
        if event.name:
            body += _text(0x12, event.name)
        body += _attributes(0x1A, event.attributes)
        body += _count(0x20, event.dropped_attributes)
        parts.append(_ld(0x5A, body))
    parts.append(_count(0x60, span.dropped_events))
    for link in span.links:
        lc = link.context
        body = (
            b"\x0a\x10"
            + lc.trace_id.to_bytes(16, "big")
            + b"\x12\x08"
            + lc.span_id.to_bytes(8, "big")
            + _attributes(0x22, link.attributes)
            + _count(0x28, link.dropped_attributes)
            + b"\x35"
            + _pack_fixed32(_flags(lc))
        )
        parts.append(_ld(0x6A, body))
    parts.append(_count(0x70, span.dropped_links))
    status = span.status
    body = b""
    if status.description:
        body += _text(0x12, status.description)
    if status.status_code.value:
        body += bytes((0x18, status.status_code.value))
    parts.append(_ld(0x7A, body))
    parts.append(b"\x85\x01" + _pack_fixed32(_flags(parent)))
    return b"".join(parts)


# Encoded once per object: a process has one or a few resources and scopes.
_resources: dict[int, tuple[Resource, bytes]] = {}
_scopes: dict[InstrumentationScope | None, bytes] = {}


def _resource(resource: Resource) -> bytes:
    hit = _resources.get(id(resource))
    if hit is not None and hit[0] is resource:
        return hit[1]
    encoded = _ld(0x0A, _attributes(0x0A, resource.attributes))
    if len(_resources) >= _CACHE_MAX:
        _resources.clear()
    _resources[id(resource)] = (resource, encoded)
    return encoded


def _scope(scope: InstrumentationScope | None) -> bytes:
    hit = _scopes.get(scope)
    if hit is not None:
        return hit
    body = b""
    if scope is not None:
        if scope.name:
            body += _text(0x0A, scope.name)
        if scope.version:
            body += _text(0x12, scope.version)
        body += _attributes(0x1A, scope.attributes)
    encoded = _ld(0x0A, body)
    if len(_scopes) >= _CACHE_MAX:
        _scopes.clear()
    _scopes[scope] = encoded
    return encoded


def _direct(spans: Sequence[ReadableSpan]) -> bytes:
    # Grouped as the SDK groups them: by resource (equal resources are one), then by
    # scope, each in order of first appearance.
    groups: dict[int, tuple[Resource, dict[InstrumentationScope | None, list[bytes]]]] = {}
    for span in spans:
        resource = span.resource
        group = groups.get(id(resource))
        if group is None:
            for other in groups.values():
                if other[0] == resource:
                    group = other
                    break
            else:
                group = groups[id(resource)] = (resource, {})
        group[1].setdefault(span.instrumentation_scope or None, []).append(_span(span))
    out = []
    for resource, scopes in groups.values():
        body = [_resource(resource)]
        for scope, encoded in scopes.items():
            scope_body = _scope(scope) + b"".join([_ld(0x12, s) for s in encoded])
            if scope is not None and scope.schema_url:
                scope_body += _text(0x1A, scope.schema_url)
            body.append(_ld(0x12, scope_body))
        if resource.schema_url:
            body.append(_text(0x1A, resource.schema_url))
        out.append(_ld(0x0A, b"".join(body)))
    return b"".join(out)


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def string_item_bytes(value: str) -> int:
    """The bytes ``value`` adds to a span's encoding as one more item of a string array
    attribute: its AnyValue and both length prefixes. The prefixes of the fields around
    the array grow too as it does, by a few bytes at most (a varint each)."""
    n = len(value) if value.isascii() else len(value.encode("utf-8"))
    if n < 126:  # the common case: both prefixes a byte long
        return n + 4
    inner = 1 + _varint_len(n) + n  # AnyValue{string_value}
    return 1 + _varint_len(inner) + inner  # ArrayValue.values item


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """The ExportTraceServiceRequest bytes for ``spans``, as the SDK would encode them."""
    try:
        return _direct(spans)
    except _Unusual:
        return encode_spans(spans).SerializeToString()
