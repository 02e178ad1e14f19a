"""Fuzz the sidecar's OTLP/HTTP intake with generated bodies, protobuf and JSON.

A live sidecar process takes SAGA_CHAOS_FUZZ (default 10,000) bodies, some
gzipped: Hypothesis generates a share (random bytes, valid requests with
hostile attributes, truncated and flipped protobuf, random JSON and OTLP-shaped
JSON with wrong types) and a seeded mutational fuzzer, far cheaper per body,
derives the rest from real contract requests in both encodings. Every answer
must be a 2xx/4xx (or an overload 429/503), the process must keep serving, and
its memory must stay flat once warm.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from support import SidecarProcess, start_sidecar

from saga_otel import semconv as sc

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

TOTAL = int(os.environ.get("SAGA_CHAOS_FUZZ", "10000"))
ALLOWED = {200, 400, 413, 415, 429, 503}
KEYS = [
    sc.SAGA_PHASE,
    sc.SAGA_RUN_ID,
    sc.SAGA_NAME,
    sc.SAGA_CONTRACT_VERSION,
    sc.SAGA_STEP_INDEX,
    sc.SAGA_STEP_NAME,
    sc.SAGA_STEP_CLASS,
    sc.SAGA_STEP_PIVOT,
    sc.SAGA_COMPENSATION_TOOL,
    sc.SAGA_COMPENSATION_ARGS,
    sc.SAGA_STACK,
    sc.SAGA_ESCALATION_CARD,
    sc.SAGA_HEARTBEAT_OPEN_RUNS,
    sc.SAGA_RUN_STATUS,
    "other.key",
]
PHASES = [*sorted(sc.PHASES), "nonsense", ""]

any_values = st.one_of(
    st.builds(lambda v: AnyValue(string_value=v), st.text(max_size=40)),
    st.builds(lambda v: AnyValue(string_value=v), st.sampled_from(PHASES)),
    st.builds(lambda v: AnyValue(int_value=v), st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda v: AnyValue(double_value=v), st.floats(allow_nan=True)),
    st.builds(lambda v: AnyValue(bool_value=v), st.booleans()),
    st.builds(lambda v: AnyValue(bytes_value=v), st.binary(max_size=20)),
    st.just(AnyValue()),
    st.builds(
        lambda vs: AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=v) for v in vs])),
        st.lists(st.sampled_from(PHASES), max_size=3),
    ),
)
key_values = st.builds(
    lambda k, v: KeyValue(key=k, value=v), st.sampled_from(KEYS) | st.text(max_size=10), any_values
)
spans = st.builds(
    lambda tid, sid, attrs, start, end, name: Span(
        trace_id=tid, span_id=sid, attributes=attrs, start_time_unix_nano=start,
        end_time_unix_nano=end, name=name,
    ),
    st.binary(max_size=17),
    st.binary(max_size=9),
    st.lists(key_values, max_size=12),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.text(max_size=20),
)  # fmt: skip
requests = st.builds(
    lambda ss: ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=ss)])]
    ),
    st.lists(spans, max_size=6),
)


@st.composite
def protobuf_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "valid", "truncated", "flipped"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    data = draw(requests).SerializeToString()
    if kind == "truncated" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind == "flipped" and data:
        i = draw(st.integers(0, len(data) - 1))
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    return data


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)
)
json_any = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
otlp_json = st.fixed_dictionaries(
    {
        "resourceSpans": st.lists(
            st.fixed_dictionaries(
                {
                    "scopeSpans": st.lists(
                        st.fixed_dictionaries(
                            {
                                "spans": st.lists(
                                    st.fixed_dictionaries(
                                        {
                                            "traceId": st.text("0123456789abcdef", max_size=34),
                                            "spanId": st.text("0123456789abcdefXYZ", max_size=18),
                                            "name": json_any,
                                            "attributes": st.lists(
                                                st.fixed_dictionaries(
                                                    {
                                                        "key": st.sampled_from(KEYS),
                                                        "value": json_any,
                                                    }
                                                ),
                                                max_size=8,
                                            ),
                                            "startTimeUnixNano": json_any,
                                        }
                                    ),
                                    max_size=4,
                                )
                            }
                        ),
                        max_size=2,
                    )
                }
            ),
            max_size=2,
        )
    }
)


@st.composite
def json_bodies(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        doc: Any = draw(otlp_json)
    else:
        doc = draw(json_any)
    text = json.dumps(doc)
    if draw(st.integers(0, 9)) == 0:
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    return text.encode()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Any:
    sp: SidecarProcess = start_sidecar(Path(tmp_path_factory.mktemp("fuzz")))
    client = httpx.Client(timeout=10)
    yield sp, client, psutil.Process(sp.proc.pid)
    client.close()
    sp.stop()


STATUSES: Counter[str] = Counter()


def _send(live: Any, body: bytes, media: str, gz: bool) -> None:
    sp, client, _ = live
    headers = {"Content-Type": media}
    if gz:
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    resp = client.post(f"{sp.otlp}/v1/traces", content=body, headers=headers)
    STATUSES[f"{media.split('/')[1]} {resp.status_code}"] += 1
    assert resp.status_code in ALLOWED, (resp.status_code, resp.text[:300], body[:200])
    assert sp.proc.poll() is None, "the sidecar died"


# Hypothesis spends ~20 ms drawing one structured body; it takes a fifth of the
# total, the mutational fuzzer below the rest.
HYPOTHESIS_SHARE = max(1, TOTAL // 10)
SETTINGS = settings(
    max_examples=HYPOTHESIS_SHARE,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


@SETTINGS
@given(body=protobuf_bodies(), gz=st.booleans())
def test_fuzz_protobuf_bodies(live: Any, body: bytes, gz: bool) -> None:
    _send(live, body, "application/x-protobuf", gz)


@SETTINGS
@given(body=json_bodies(), gz=st.booleans())
def test_fuzz_json_bodies(live: Any, body: bytes, gz: bool) -> None:
    _send(live, body, "application/json", gz)


def _seed_requests() -> list[ExportTraceServiceRequest]:
    """Real contract requests: a do span that pushed an undo, an unwind, a heartbeat."""

    def kv(key: str, value: Any) -> KeyValue:
        if isinstance(value, bool):
            return KeyValue(key=key, value=AnyValue(bool_value=value))
        if isinstance(value, int):
            return KeyValue(key=key, value=AnyValue(int_value=value))
        return KeyValue(key=key, value=AnyValue(string_value=str(value)))

    ident = {sc.SAGA_RUN_ID: "ab" * 16, sc.SAGA_NAME: "refund", sc.SAGA_CONTRACT_VERSION: 1}
    do = {**ident, sc.SAGA_PHASE: "do", sc.SAGA_STEP_NAME: "issue_credit", sc.SAGA_STEP_INDEX: 1,
          sc.SAGA_STEP_CLASS: "compensable", sc.SAGA_STEP_ATTEMPT: 1, sc.SAGA_STEP_PIVOT: False,
          sc.SAGA_COMPENSATION_TOOL: "reverse_credit",
          sc.SAGA_COMPENSATION_ARGS: json.dumps({"credit_id": "cr_1"})}  # fmt: skip
    unwind = {**ident, sc.SAGA_PHASE: "unwind", sc.SAGA_UNWIND_REASON: "E: x",
              sc.SAGA_RUN_FAILED_STEP: "send_reply",
              sc.SAGA_STACK: json.dumps([{"step": "issue_credit", "index": 1,
                                          "tool": "reverse_credit", "args": {}}])}  # fmt: skip
    out = []
    for attrs in (do, unwind):
        span = Span(
            trace_id=bytes.fromhex("ab" * 16), span_id=os.urandom(8), name="saga.x",
            start_time_unix_nano=1, end_time_unix_nano=2,
            attributes=[kv(k, v) for k, v in attrs.items()],
        )  # fmt: skip
        out.append(
            ExportTraceServiceRequest(
                resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[span])])]
            )
        )
    return out


def _mutate(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        if op == 0 and data:  # flip bits
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1 and data:  # truncate
            del data[rng.randrange(len(data)) :]
        elif op == 2:  # insert junk
            i = rng.randrange(len(data) + 1)
            data[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and data:  # duplicate a chunk
            i = rng.randrange(len(data))
            data[i:i] = data[i : i + rng.randint(1, 32)]
        elif data:  # overwrite with an interesting byte
            data[rng.randrange(len(data))] = rng.choice(b'\x00\xff\x7f\x80{}[]":,')
    return bytes(data)


def test_fuzz_mutations_of_real_requests(live: Any) -> None:
    from google.protobuf import json_format

    rng = random.Random(20261202)
    seeds = [(r.SerializeToString(), "application/x-protobuf") for r in _seed_requests()]
    seeds += [(json_format.MessageToJson(r).encode(), "application/json") for r in _seed_requests()]
    for _ in range(TOTAL - 2 * HYPOTHESIS_SHARE):
        body, media = rng.choice(seeds)
        _send(live, _mutate(rng, body), media, gz=rng.random() < 0.2)


def test_memory_stays_flat_and_the_sidecar_serves_after_fuzzing(
    live: Any, chaos_results: dict[str, Any]
) -> None:
    sp, client, proc = live
    # Runs after the two fuzz tests (file order): warm now; one more round must not grow it.
    before = proc.memory_info().rss
    for i in range(2000):
        req = ExportTraceServiceRequest(
            resource_spans=[
                ResourceSpans(
                    scope_spans=[
                        ScopeSpans(
                            spans=[
                                Span(
                                    trace_id=os.urandom(16),
                                    span_id=os.urandom(8),
                                    name="noise",
                                    attributes=[
                                        KeyValue(key=sc.SAGA_PHASE, value=AnyValue(int_value=i))
                                    ],
                                )
                            ]
                        )
                    ]
                )
            ]
        )
        resp = client.post(
            f"{sp.otlp}/v1/traces",
            content=req.SerializeToString() + b"\xff" * (i % 2),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert resp.status_code in ALLOWED
    after = proc.memory_info().rss
    assert after - before < 20 * 1024 * 1024, (before, after)
    assert client.get(f"{sp.api}/healthz").status_code == 200
    chaos_results["fuzz"] = {
        "bodies": sum(STATUSES.values()),
        "answers": dict(STATUSES),
        "server_errors": sum(n for k, n in STATUSES.items() if k.endswith(" 500")),
        "rss_growth_kib_over_2000_more": (after - before) // 1024,
    }
