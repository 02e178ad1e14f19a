"""Run one behaviour test through the sync and the async driver alike.

A test is written once, as a coroutine, against :class:`Driver`; the ``mode``
fixture (tests/saga_otel/conftest.py) hands it the sync or the async driver.
The sync driver calls the blocking API (``run_sync``, ``execute_sync``,
``resume_sync``) directly, so what runs is exactly what a sync agent runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

from saga_otel import Saga, SagaReport, Step, SyncRun
from saga_otel.records import Compensation

ModeName = Literal["sync", "async"]


class SyncRunAdapter:
    """A SyncRun behind the async run's shape (``async with``, ``await run.call``)."""

    def __init__(self, run: SyncRun) -> None:
        self.inner = run

    async def __aenter__(self) -> SyncRunAdapter:
        self.inner.__enter__()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        return self.inner.__exit__(et, exc, tb)

    async def call(self, tool: str, /, **args: Any) -> Any:
        return self.inner.call(tool, **args)

    @property
    def run_id(self) -> str:
        return self.inner.run_id

    @property
    def report(self) -> SagaReport | None:
        return self.inner.report

    @property
    def stack(self) -> tuple[Compensation, ...]:
        return self.inner.stack


class Driver:
    """The engine's entry points in one mode."""

    def __init__(self, name: ModeName) -> None:
        self.name = name

    @property
    def is_async(self) -> bool:
        return self.name == "async"

    def run(
        self,
        saga: Saga,
        run_id: str | None = None,
        *,
        validate: Sequence[tuple[str, Mapping[str, Any]]] = (),
    ) -> Any:
        if self.is_async:
            return saga.run(run_id, validate=validate)
        return SyncRunAdapter(saga.run_sync(run_id, validate=validate))

    async def execute(self, saga: Saga, steps: Sequence[Step], ctx: Any = None) -> SagaReport:
        if self.is_async:
            return await saga.execute(steps, ctx)
        return saga.execute_sync(steps, ctx)

    async def resume(
        self, saga: Saga, report: SagaReport, steps: Sequence[Step] = (), ctx: Any = None
    ) -> SagaReport:
        if self.is_async:
            return await saga.resume(report, steps, ctx)
        return saga.resume_sync(report, steps, ctx)

    def sleep_kwargs(self, slept: list[float]) -> dict[str, Any]:
        """Saga(...) keyword arguments that record sleeps instead of sleeping."""

        def sleep(s: float) -> None:
            slept.append(s)

        async def async_sleep(s: float) -> None:
            slept.append(s)

        return {"async_sleep": async_sleep} if self.is_async else {"sleep": sleep}

    def fn(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """``body`` as a function of this mode: a coroutine function in async mode."""
        if not self.is_async:
            return body

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            return body(*args, **kwargs)

        wrapper.__name__ = getattr(body, "__name__", "fn")
        wrapper.__signature__ = inspect.signature(body)  # type: ignore[attr-defined]
        return wrapper


async def settle(value: Any) -> Any:
    """Await what an observed async function returned; pass a sync result through."""
    return await value if inspect.isawaitable(value) else value


async def refund_agent(run: Any, order_id: int = 4921) -> None:
    """The example refund agent, against either driver's run."""
    order = await run.call("get_order", order_id=order_id)
    credit = await run.call("issue_credit", order_id=order_id, amount=order["amount"])
    await run.call("set_ticket_status", ticket_id=order["ticket_id"], status="refunded")
    await run.call(
        "send_reply",
        ticket_id=order["ticket_id"],
        body=f"We credited {order['amount']} cents ({credit['credit_id']}).",
    )
    await run.call("close_ticket", ticket_id=order["ticket_id"])


async def run_refund(driver: Driver, saga: Saga, order_id: int = 4921) -> SagaReport:
    run = driver.run(saga)
    try:
        async with run:
            await refund_agent(run, order_id)
    except Exception:
        pass  # the report says what happened
    assert run.report is not None
    report: SagaReport = run.report
    return report
