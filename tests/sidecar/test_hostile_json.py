"""Hostile structure is a 4xx, never a 5xx: every endpoint of a real sidecar process."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saga_otel import semconv as sc
from saga_otel.testing import SidecarProcess, start_sidecar


@pytest.fixture(scope="module")
def side(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    with start_sidecar(tmp_path_factory.mktemp("hostile")) as proc:
        yield proc


def nested(depth: int, kind: str) -> str:
    if kind == "list":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=20,
)
hostile_text = st.one_of(
    st.builds(nested, st.integers(1, 5000), st.sampled_from(["list", "dict"])),
    json_values.map(json.dumps),
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
)


def span_doc(run_id: str, attr_text: str) -> dict[str, object]:
    """OTLP/JSON with one saga do span whose compensation args are ``attr_text``."""

    def attr(key: str, value: object) -> dict[str, object]:
        kind = "intValue" if isinstance(value, int) else "stringValue"
        return {"key": key, "value": {kind: value}}

    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [attr(sc.SERVICE_NAME, "agent")]},
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": "0" * 31 + "1",
                                "spanId": "0" * 15 + "1",
                                "name": "saga.do x",
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000000100000000",
                                "attributes": [
                                    attr(sc.SAGA_RUN_ID, run_id),
                                    attr(sc.SAGA_NAME, "refund"),
                                    attr(sc.SAGA_CONTRACT_VERSION, sc.CONTRACT_VERSION),
                                    attr(sc.SAGA_PHASE, sc.PHASE_DO),
                                    attr(sc.SAGA_STEP_NAME, "issue_credit"),
                                    attr(sc.SAGA_STEP_INDEX, 0),
                                    attr(sc.SAGA_STEP_CLASS, "compensable"),
                                    attr(sc.SAGA_STEP_ATTEMPT, 1),
                                    attr(sc.SAGA_COMPENSATION_TOOL, "reverse_credit"),
                                    attr(sc.SAGA_COMPENSATION_ARGS, attr_text),
                                ],
                                "status": {"code": 1},
                            }
                        ]
                    }
                ],
            }
        ]
    }


def check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.request.method, resp.request.url, resp.text[:300])


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(text=hostile_text, n=st.integers(0, 10**6))
def test_no_endpoint_answers_5xx_to_nested_or_malformed_json(
    side: SidecarProcess, text: str, n: int
) -> None:
    run_id = f"hostile-{n}"
    body = text.encode("utf-8", "surrogatepass")
    with httpx.Client(timeout=30) as client:
        for ctype in ("application/json", "application/x-protobuf"):
            check(
                client.post(f"{side.otlp}/v1/traces", content=body, headers={"Content-Type": ctype})
            )
        # The same text as a stored attribute, then every view that shows it.
        stored = client.post(
            f"{side.otlp}/v1/traces",
            json=span_doc(run_id, text),
            headers={"Content-Type": "application/json"},
        )
        check(stored)
        cursor = base64.urlsafe_b64encode(body).decode().rstrip("=")
        for path, params in (
            ("/runs", {"limit": text[:50]}),
            ("/runs", {"cursor": cursor}),
            ("/runs", {"since": text[:50], "status": text[:20]}),
            ("/runs", {}),
            (f"/runs/{run_id}", {}),
            (f"/runs/{run_id}/stack", {}),
            ("/healthz", {}),
            ("/metrics", {}),
        ):
            check(client.get(f"{side.api}{path}", params=params))
        for target in (run_id, "unknown-run"):
            check(client.post(f"{side.api}/runs/{target}/resolve", content=body))


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/runs", {"limit": "³"}),
        ("/runs", {"limit": "٣"}),
        ("/runs", {"cursor": base64.urlsafe_b64encode(nested(3000, "list").encode()).decode()}),
    ],
)
def test_known_hostile_api_parameters_get_a_400_with_a_message(
    side: SidecarProcess, path: str, params: dict[str, str]
) -> None:
    resp = httpx.get(f"{side.api}{path}", params=params, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"], resp.text


@pytest.mark.parametrize("depth", [400, 3000, 10_000])
def test_deeply_nested_bodies_get_a_400(side: SidecarProcess, depth: int) -> None:
    for kind in ("list", "dict"):
        resp = httpx.post(
            f"{side.otlp}/v1/traces",
            content=nested(depth, kind),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert resp.status_code == 400, resp.text
        for route in ("lease", "lease/renew", "lease/release", "resolve"):
            resp = httpx.post(
                f"{side.api}/runs/any/{route}", content=nested(depth, kind), timeout=30
            )
            assert resp.status_code == 400, (route, resp.text)
            assert "nested deeper" in resp.json()["error"], (route, resp.text)


def test_a_lease_token_too_long_for_an_integer_is_named(side: SidecarProcess) -> None:
    """JSON's own limit on integer digits (Python's 4,300) is the problem to name, not
    "needs a JSON object body": the body is one."""
    body = '{"holder": "a", "token": ' + "9" * 5000 + "}"
    resp = httpx.post(f"{side.api}/runs/any/lease/renew", content=body, timeout=30)
    assert resp.status_code == 400, resp.text
    doc = resp.json()
    assert doc["reason"] == "bad_request" and "digits" in doc["error"], doc


def test_sidecar_log_has_no_traceback(side: SidecarProcess) -> None:
    text = Path(side.log).read_text()
    # aiohttp logs its own 400 for an over-long URL (a huge cursor) with a traceback.
    assert text.count("Traceback") == text.count("http_exceptions.LineTooLong"), text[-3000:]
