"""The outcome layer on its own: one composed outcome, run sync (called) or async (awaited)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from saga_modes import Driver
from support import run_child

from saga_otel import _acks
from saga_otel._outcome import (
    AsyncMode,
    Immediate,
    Mode,
    Outcome,
    Pending,
    Script,
    SyncMode,
    retrying,
)


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

    def script() -> Script[None]:
        log.append("script")
        yield m.call(log.append, "called")
        yield m.run(lambda: log.append("then"))

    o = m.script(script)
    assert log == []  # not even the generator's first line
    await drive(o)
    assert log == ["script", "called", "then"]
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


async def test_a_script_gets_each_value_back_in_order(mode: Driver) -> None:
    m = make_mode(mode)
    seen: list[int] = []

    def script() -> Script[int]:
        total = 0
        for i in (1, 2, 3):
            total += yield m.run(lambda i=i: seen.append(i) or i)  # type: ignore[func-returns-value]
        doubled = yield m.pure(total).map(lambda v: v * 2)
        return int(doubled)

    assert await drive(m.script(script)) == 12
    assert seen == [1, 2, 3]


async def test_a_script_sees_the_same_exception_and_may_recover(mode: Driver) -> None:
    m = make_mode(mode)
    err = ValueError("boom")

    def fail() -> int:
        raise err

    def recovering() -> Script[object]:
        try:
            yield m.run(fail)
        except ValueError as exc:
            return exc
        return None

    assert await drive(m.script(recovering)) is err

    def passing_through() -> Script[None]:
        yield m.run(fail)

    with pytest.raises(ValueError) as info:
        await drive(m.script(passing_through))
    assert info.value is err and info.value.__context__ is None


async def test_a_users_stop_iteration_reaches_the_script_and_its_caller_as_itself(
    mode: Driver,
) -> None:
    """Python turns a StopIteration leaving a generator or coroutine frame into
    RuntimeError (PEP 479): the drivers hand the user's own object to the script, through
    the script's own generator frames, and out to its caller. An async caller awaits a
    coroutine, which can never raise StopIteration: it gets Python's RuntimeError with
    the object as its __cause__, as from any async function."""
    m = make_mode(mode)
    err = StopIteration("no matching order")

    def fail() -> None:
        raise err

    def catching() -> Script[object]:
        try:
            yield m.call(fail)
        except StopIteration as exc:
            return exc
        return None

    assert await drive(m.script(catching)) is err

    def inner() -> Script[None]:
        yield m.call(fail)

    def outer() -> Script[None]:
        yield from inner()  # a generator frame between the yield and the driver

    def nested() -> Script[None]:
        yield m.script(outer)  # and a driver between this script and the call

    for body in (outer, nested):
        o = m.script(body)
        with pytest.raises(BaseException) as info:
            if isinstance(o, Immediate):
                o()  # called here: drive() is a coroutine, which would make it a RuntimeError
            else:
                await drive(o)
        if mode.is_async:
            assert type(info.value) is RuntimeError and info.value.__cause__ is err
        else:
            assert info.value is err and info.value.__context__ is None


async def test_a_with_block_around_a_yield_spans_the_whole_call(mode: Driver) -> None:
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

    def body() -> Script[str]:
        with cm("a") as handle:
            yield m.call(mode.fn(lambda: log.append("body")))
        return handle.upper()

    assert await drive(m.script(body)) == "A"
    assert log == ["enter a", "body", "exit a"]
    log.clear()

    def fail() -> None:
        raise KeyError("x")

    def failing() -> Script[None]:
        with cm("c"):
            yield m.run(fail)

    with pytest.raises(KeyError):
        await drive(m.script(failing))
    assert log == ["enter c", "c saw KeyError", "exit c"]


async def test_retry_backs_off_between_attempts_and_reraises_the_last(mode: Driver) -> None:
    slept: list[float] = []
    m = make_mode(mode, slept)
    tries: list[int] = []
    errors: list[BaseException] = []

    def attempt(n: int) -> Script[int]:
        def body() -> int:
            tries.append(n)
            if n < 3:
                errors.append(ConnectionError(f"try {n}"))
                raise errors[-1]
            return n

        value: int = yield m.run(body)
        return value

    assert await drive(m.script(lambda: retrying(m, 5, lambda n: n * 0.5, attempt))) == 3
    assert tries == [1, 2, 3] and slept == [0.5, 1.0]
    tries.clear()
    slept.clear()
    errors.clear()
    with pytest.raises(ConnectionError, match="try 2") as info:
        await drive(m.script(lambda: retrying(m, 2, lambda n: 0.1, attempt)))
    assert tries == [1, 2] and slept == [0.1]
    # The last attempt's own exception, not chained onto the one before it.
    assert info.value is errors[-1] and info.value.__context__ is None


async def test_retry_never_retries_a_base_exception(mode: Driver) -> None:
    m = make_mode(mode)
    tries: list[int] = []

    def attempt(n: int) -> Script[None]:
        def body() -> None:
            tries.append(n)
            raise KeyboardInterrupt

        yield m.run(body)

    with pytest.raises(KeyboardInterrupt):
        await drive(m.script(lambda: retrying(m, 3, lambda n: 0.0, attempt)))
    assert tries == [1]


async def test_a_script_of_the_other_mode_is_refused_in_the_script() -> None:
    async_mode, sync_mode = AsyncMode(), SyncMode()

    def wrong(other: Mode) -> Script[object]:
        try:
            yield other.pure(2)
        except TypeError as exc:
            return str(exc)
        return None

    assert "same Mode" in str(await drive(async_mode.script(lambda: wrong(sync_mode))))
    assert "same Mode" in str(await drive(sync_mode.script(lambda: wrong(async_mode))))


async def test_shield_finishes_the_work_when_the_caller_is_cancelled() -> None:
    m = AsyncMode()
    started, gate, done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        started.set()
        await gate.wait()
        done.set()
        return "finished"

    task = asyncio.ensure_future(m.shield(m.call(slow))())
    await started.wait()
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()  # twice: still shielded
    await asyncio.sleep(0)
    gate.set()
    with pytest.raises(asyncio.CancelledError):  # delivered once the work is done
        await task
    assert done.is_set() and task.cancelled()


async def test_shield_redelivers_a_cancellation_over_the_works_error_not_an_interrupt() -> None:
    m = AsyncMode()

    async def cancelled_while(raised: BaseException) -> BaseException:
        # The shield runs in this test's own task: asyncio re-raises an interrupt that
        # ends a task out of the event loop itself.
        me = asyncio.current_task()
        assert me is not None
        started, gate = asyncio.Event(), asyncio.Event()

        async def work() -> None:
            started.set()
            await gate.wait()
            raise raised

        async def cancel_me() -> None:
            await started.wait()
            me.cancel()
            await asyncio.sleep(0)
            gate.set()

        helper = asyncio.ensure_future(cancel_me())
        try:
            await m.shield(m.call(work))()
        except BaseException as exc:
            return exc
        finally:
            await helper
            me.uncancel()  # this test's task goes on
        raise AssertionError("the shield returned")

    # The work's own error stays in the chain of the cancellation (asyncio.timeout
    # turns that into TimeoutError; a TaskGroup sees its child cancelled).
    error = ValueError("undo failed")
    got = await cancelled_while(error)
    assert isinstance(got, asyncio.CancelledError) and got.__context__ is error
    # An interrupt from the work asks the process to stop: it is not demoted.
    interrupt = KeyboardInterrupt()
    assert await cancelled_while(interrupt) is interrupt


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


async def test_a_long_script_runs_without_nesting(mode: Driver) -> None:
    m = make_mode(mode)
    seen: list[int] = []

    def script() -> Script[None]:
        for i in range(5000):
            yield m.run(lambda i=i: seen.append(i))

    await drive(m.script(script))
    assert seen == list(range(5000))


async def test_a_cancelled_async_script_closes_its_with_blocks_and_stays_cancelled() -> None:
    m = AsyncMode()
    log: list[str] = []
    started = asyncio.Event()

    @contextlib.contextmanager
    def cm() -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            log.append(type(exc).__name__)
            raise

    async def slow() -> None:
        started.set()
        await asyncio.sleep(10)

    def script() -> Script[None]:
        with cm():
            yield m.call(slow)
        log.append("after")  # never reached

    task = asyncio.ensure_future(m.script(script)())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["CancelledError"] and task.cancelled()


async def test_until_waits_for_its_condition_as_its_signal_rings(mode: Driver) -> None:
    """The wait the unwind uses for its writes in flight: re-read each time the signal
    rings (from a task, or another thread in sync mode), True once the condition holds,
    False once the bound passed without it; a ring with the condition still false is
    waited past."""
    m = make_mode(mode)
    signal = m.signal()
    done: list[bool] = []

    def ring_twice() -> None:
        signal.ring()  # not done yet: the waiter must keep waiting
        done.append(True)
        signal.ring()

    if mode.is_async:
        asyncio.get_running_loop().call_soon(ring_twice)
        assert await drive(m.until(lambda: bool(done), signal, 30)) is True
    else:
        ringer = threading.Thread(target=ring_twice)
        ringer.start()
        assert await drive(m.until(lambda: bool(done), signal, 30)) is True
        ringer.join()
    assert await drive(m.until(lambda: False, signal, 0)) is False


# -- a sync mode shared by threads: its turn -------------------------------------------
def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    """``fn()`` on a thread of its own, started: the thread and what fn returned."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("leaf", ["call", "sleep", "ack", "until"])
def test_a_blocking_sync_leaf_lets_another_thread_drive_the_mode_meanwhile(
    leaf: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sync driver holds the mode's turn around a script's own code, and lets go of
    it while a leaf blocks (the tool, a retry's sleep, the ack wait, the unwind's wait for
    writes in flight), so the threads sharing a run call their tools at once."""
    blocked, other_ran = threading.Event(), threading.Event()

    def block(*_args: Any) -> bool:
        blocked.set()
        return other_ran.wait(5)

    monkeypatch.setattr(_acks, "wait_for_ack", block)
    m = SyncMode(block)
    signal = m.signal()

    def done() -> bool:
        blocked.set()
        return other_ran.is_set()

    leaves = {
        "call": lambda: m.call(block),
        "sleep": lambda: m.sleep(1),
        "ack": lambda: m.ack(None),
        "until": lambda: m.until(done, signal, 5),
    }

    def first() -> Script[bool]:
        yield leaves[leaf]()
        return other_ran.is_set()  # held the turn throughout: the other could not run

    def second() -> Script[None]:
        yield m.run(other_ran.set)
        signal.ring()

    waiter, got = _in_thread(lambda: m.drive(lambda: m.script(first)))
    assert blocked.wait(5)
    other, _ = _in_thread(lambda: m.drive(lambda: m.script(second)))
    other.join(10)
    waiter.join(10)
    assert other_ran.is_set() and not other.is_alive()
    assert got == [True]


def test_a_driven_sync_modes_script_code_runs_one_thread_at_a_time() -> None:
    """Between two yields a script runs whole: another thread driving the same mode
    starts only once this one reaches a blocking leaf (as a task starts only at an
    await)."""
    m = SyncMode()
    entered, other_started = threading.Event(), threading.Event()
    seen: list[bool] = []

    def holder() -> Script[None]:
        entered.set()
        seen.append(other_started.wait(0.2))  # code of the script: holding the turn
        yield m.call(lambda: other_started.wait(5))  # a blocking leaf: the other runs now
        seen.append(other_started.is_set())

    def other() -> Script[None]:
        other_started.set()
        yield m.pure(None)

    first, _ = _in_thread(lambda: m.drive(lambda: m.script(holder)))
    assert entered.wait(5)
    second, _ = _in_thread(lambda: m.drive(lambda: m.script(other)))
    first.join(10)
    second.join(10)
    assert seen == [False, True]


def test_a_driven_sync_mode_is_driven_again_from_its_own_code() -> None:
    """Code the run calls back while it holds the turn (an escalation handler, a span
    processor) may drive the same mode again on its thread: no deadlock, and a blocking
    leaf in there still lets other threads in."""
    m = SyncMode()
    blocked, other_ran = threading.Event(), threading.Event()

    def inner() -> Script[bool]:
        blocked.set()
        return (yield m.call(lambda: other_ran.wait(5)))

    def outer() -> Script[bool]:
        nested = m.drive(lambda: m.script(inner))  # from the script's own code
        yield m.pure(None)
        return nested

    first, got = _in_thread(lambda: m.drive(lambda: m.script(outer)))
    assert blocked.wait(5)
    second, _ = _in_thread(lambda: m.drive(lambda: m.script(lambda: _run(m, other_ran.set))))
    second.join(10)
    first.join(10)
    assert got == [True] and not first.is_alive()


def _run(m: SyncMode, fn: Any) -> Script[None]:
    yield m.run(fn)


# Ctrl-C in the main thread can be raised just after its acquire() took a run's turn,
# before the next line records it. Each case runs in a child (signals go to its main
# thread) under a timeout: the bug was a turn held for ever.
_CHILD_PREAMBLE = """
import signal, sys, threading, time
from saga_otel._outcome import _Turn
main = threading.get_ident()

def free(turn):
    # Another thread can take the turn: it was not left held.
    got = threading.Event()
    def take():
        with turn:
            got.set()
    t = threading.Thread(target=take, daemon=True)
    t.start()
    return got.wait(10)
"""

_INTERRUPTED_TAKE = """
held_for_ever = 0
for _ in range(200):
    turn = _Turn()
    held, sent = threading.Event(), threading.Event()
    def other():
        with turn:
            held.set()
            time.sleep(0.002)
        signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C as the turn is handed over
        sent.set()
    t = threading.Thread(target=other)
    t.start()
    try:
        held.wait()
        try:
            with turn:
                pass
        except KeyboardInterrupt:
            pass
        sent.wait()
        time.sleep(0.01)  # a signal not raised yet is raised here, not in t.join()
    except KeyboardInterrupt:
        pass
    t.join()
    held_for_ever += not free(turn)
print("held for ever:", held_for_ever)
"""

_INTERRUPTED_RETAKE = """
turn = _Turn()
turn.__enter__()  # the main thread drives the run
in_leaf, held, sent = threading.Event(), threading.Event(), threading.Event()
def other():
    in_leaf.wait()
    with turn:  # another thread's turn while the main thread's tool runs
        held.set()
        time.sleep(0.05)
    signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C as the turn comes back
    sent.set()
threading.Thread(target=other, daemon=True).start()
def leaf():
    in_leaf.set()
    held.wait()
outcome = "no interrupt"
try:
    try:
        turn.released(leaf)
    except KeyboardInterrupt:
        outcome = "interrupted"
    sent.wait()
    time.sleep(0.01)  # a signal not raised yet is raised here
except KeyboardInterrupt:
    pass
print(outcome)
print("holds it:", turn._holds())
turn.__exit__(None, None, None)
print("free after:", free(turn))
"""


def _child(body: str) -> str:
    done = run_child(_CHILD_PREAMBLE + body)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_ctrl_c_as_a_thread_takes_the_turn_never_leaves_it_held() -> None:
    assert _child(_INTERRUPTED_TAKE).splitlines() == ["held for ever: 0"]


@pytest.mark.parametrize("attempt", range(5))
def test_ctrl_c_as_the_turn_comes_back_after_a_leaf_is_raised_holding_it(attempt: int) -> None:
    lines = _child(_INTERRUPTED_RETAKE).splitlines()
    assert lines[1:] == ["holds it: True", "free after: True"], lines
