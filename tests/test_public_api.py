"""The public surface of both packages, pinned: a change here is a deliberate API change."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import saga_otel
import sidecar

SAGA_OTEL = [
    "CallContext", "CallInfo", "Compensation", "CompensationOutcome", "ConfigurationError",
    "EscalationCard", "NothingToRecoverError", "ObservedRun", "PendingCall", "RecoveryError",
    "RecoveryRefusedError", "RetryPolicy", "Run",
    "RunStatus", "Saga", "SagaError", "SagaReport", "SidecarExport", "Step", "StepClass",
    "StepRecord", "StepRefusedError", "SyncRun", "Tool", "ToolRegistry", "UnknownToolError",
    "ValidationRejectedError", "configure", "current_call", "fetch_run", "find_run_id",
    "idempotency_key", "observed", "observed_run", "recover", "start_metrics_server", "tool",
    "tool_call_id",
]  # fmt: skip
SIDECAR = [
    "ApiError", "ConfigError", "DecodeError", "Listener", "RunState", "Settings", "Sidecar",
    "SidecarError", "SpanEvent", "SpanRecord", "StoreError", "Transition", "render_run",
]  # fmt: skip


@pytest.mark.parametrize(("module", "names"), [(saga_otel, SAGA_OTEL), (sidecar, SIDECAR)])
def test_all_is_sorted_pinned_and_importable(module: object, names: list[str]) -> None:
    exported = module.__all__  # type: ignore[attr-defined]
    assert exported == sorted(exported)
    assert exported == names
    for name in exported:
        assert getattr(module, name) is not None


@pytest.mark.parametrize("package", ["saga_otel", "sidecar"])
def test_packages_ship_py_typed(package: str) -> None:
    mod = importlib.import_module(package)
    assert (Path(mod.__file__).parent / "py.typed").exists()  # type: ignore[arg-type]


def test_one_base_exception_per_package() -> None:
    for name in saga_otel.__all__:
        obj = getattr(saga_otel, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, saga_otel.SagaError), name
    for name in sidecar.__all__:
        obj = getattr(sidecar, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, sidecar.SidecarError), name


def test_no_metric_has_a_run_id_label() -> None:
    from prometheus_client import CollectorRegistry

    from saga_otel._metrics import metrics_for

    reg = CollectorRegistry()
    metrics_for(reg)
    for metric in reg.collect():
        for sample in metric.samples:
            assert "run_id" not in sample.labels
    for field in metrics_for(reg).__dataclass_fields__:
        labels = getattr(metrics_for(reg), field)._labelnames
        assert "run_id" not in labels and "run" not in labels, field
