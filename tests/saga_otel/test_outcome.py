"""The outcome layer on its own: one composed outcome, run sync (called) or async (awaited)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from saga_modes import Driver

from saga_otel._outcome import AsyncMode, Immediate, Mode, Outcome, Pending, SyncMode


def make_mode(mode: Driver, slept: list[float] | None = None) -> Mode:
    record = slept if slept is not None else []

    def sleep(s: float) -> None:
        record.append(s)

    async def async_sleep(s: float) -> None:
        record.append(s)

    return AsyncMode(async_sleep) if mode.is_async else SyncMode(sleep)


async def drive(o: Outcome[Any]) -> Any:
    """The two drivers: call an Immediate, await a Pending."""
    if isinstance(o, Pending):
        return await o()
    assert isinstance(o, Immediate)
    return o()


async def test_nothing_runs_until_the_driver_runs_it(mode: Driver) -> None:
    m = make_mode(mode)
    log: list[str] = []
    o = m.call(log.append, "called").then(lambda _: m.run(lambda: log.append("then")))
    assert log == []
    await drive(o)
    assert log == ["called", "then"]
    assert isinstance(o, Pending if mode.is_async else Immediate)


async def test_call_awaits_an_awaitable_only_in_async_mode(mode: Driver) -> None:
    m = make_mode(mode)

    async def coro() -> int:
        return 7

    assert await drive(m.call(mode.fn(lambda x: x + 1), 1)) == 2
    if mode.is_async:
        assert await drive(m.call(coro)) == 7
    else:
        out = await drive(m.call(coro))
        assert asyncio.iscoroutine(out)  # a sync driver never awaits; the engine refuses it
        out.close()


async def test_map_then_and_each_keep_order(mode: Driver) -> None:
    m = make_mode(mode)
    seen: list[int] = []
    o = m.each([1, 2, 3], lambda i: m.run(lambda: seen.append(i))).map(lambda _: len(seen))
    assert await drive(o) == 3
    assert seen == [1, 2, 3]
    assert await drive(m.pure(2).map(lambda v: v * 10).then(lambda v: m.pure(v + 1))) == 21


async def test_intercept_recovers_or_reraises_the_same_exception(mode: Driver) -> None:
    m = make_mode(mode)
    err = ValueError("boom")

    def fail() -> int:
        raise err

    recovered = m.run(fail).intercept(lambda exc: m.pure(-1))
    assert await drive(recovered) == -1
    with pytest.raises(ValueError) as info:
        await drive(m.run(fail).intercept(lambda exc: None))
    assert info.value is err
    # Only the given type is caught.
    with pytest.raises(ValueError):
        await drive(m.run(fail).intercept(lambda exc: m.pure(0), KeyError))


async def test_also_and_within_wrap_the_whole_run_of_the_body(mode: Driver) -> None:
    m = make_mode(mode)
    log: list[str] = []

    @contextlib.contextmanager
    def cm(name: str) -> Iterator[str]:
        log.append(f"enter {name}")
        try:
            yield name
        except BaseException as exc:
            log.append(f"{name} saw {type(exc).__name__}")
            raise
        finally:
            log.append(f"exit {name}")

    body = m.call(mode.fn(lambda: log.append("body")))
    await drive(body.also(lambda: cm("a")))
    assert log == ["enter a", "body", "exit a"]
    log.clear()
    got = await drive(m.within(lambda: cm("b"), lambda handle: m.pure(handle.upper())))
    assert got == "B" and log == ["enter b", "exit b"]
    log.clear()

    def fail() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        await drive(m.run(fail).also(lambda: cm("c")))
    assert log == ["enter c", "c saw KeyError", "exit c"]


async def test_retry_backs_off_between_attempts_and_reraises_the_last(mode: Driver) -> None:
    slept: list[float] = []
    m = make_mode(mode, slept)
    tries: list[int] = []

    def attempt(n: int) -> Outcome[int]:
        def body() -> int:
            tries.append(n)
            if n < 3:
                raise ConnectionError(f"try {n}")
            return n

        return m.run(body)

    assert await drive(m.retry(5, lambda n: n * 0.5, attempt)) == 3
    assert tries == [1, 2, 3] and slept == [0.5, 1.0]
    tries.clear()
    slept.clear()
    with pytest.raises(ConnectionError, match="try 2"):
        await drive(m.retry(2, lambda n: 0.1, attempt))
    assert tries == [1, 2] and slept == [0.1]


async def test_retry_never_retries_a_base_exception(mode: Driver) -> None:
    m = make_mode(mode)
    tries: list[int] = []

    def attempt(n: int) -> Outcome[None]:
        def body() -> None:
            tries.append(n)
            raise KeyboardInterrupt

        return m.run(body)

    with pytest.raises(KeyboardInterrupt):
        await drive(m.retry(3, lambda n: 0.0, attempt))
    assert tries == [1]


async def test_a_sync_outcome_cannot_continue_an_async_one() -> None:
    with pytest.raises(TypeError, match="same Mode"):
        await drive(AsyncMode().pure(1).then(lambda _: SyncMode().pure(2)))
    with pytest.raises(TypeError, match="same Mode"):
        SyncMode().pure(1).then(lambda _: AsyncMode().pure(2))()


async def test_shield_finishes_the_work_when_the_caller_is_cancelled() -> None:
    m = AsyncMode()
    done = asyncio.Event()

    async def slow() -> str:
        await asyncio.sleep(0.05)
        done.set()
        return "finished"

    task = asyncio.ensure_future(m.shield(m.call(slow))())
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()  # twice: still shielded
    assert await task == "finished"  # the shield swallowed both cancellations
    assert done.is_set()


async def test_shield_carries_an_interrupt_out_of_its_task() -> None:
    # asyncio would re-raise a KeyboardInterrupt escaping a task out of the loop itself.
    m = AsyncMode()

    def interrupt() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await m.shield(m.run(interrupt))()


async def test_async_sleep_and_ack_do_not_block_the_loop() -> None:
    m = AsyncMode()  # real asyncio.sleep
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    t = asyncio.ensure_future(ticker())
    t0 = time.perf_counter()
    await m.sleep(0.05)()
    assert await m.ack(object())() is True  # no durable processor took it: at once
    t.cancel()
    assert time.perf_counter() - t0 >= 0.05
    assert ticks >= 5  # the loop ran meanwhile


async def test_each_runs_long_sequences_without_nesting(mode: Driver) -> None:
    m = make_mode(mode)
    seen: list[int] = []
    await drive(m.each(range(5000), lambda i: m.run(lambda: seen.append(i))))
    assert seen == list(range(5000))
