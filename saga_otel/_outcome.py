"""Outcomes: a step's policy written once, run by a sync or an async driver.

An :class:`Outcome` is a not-yet-run computation. :class:`Immediate` wraps a
plain thunk and runs it when called; :class:`Pending` wraps a coroutine
function and runs it when awaited. A :class:`Mode` makes the leaves: calling a
user function, sleeping between retries, waiting for the sidecar's
acknowledgement, waiting (bounded) for a condition a :class:`Signal` rings,
shielding from cancellation. :class:`SyncMode` blocks (its signal a
``threading.Condition``); :class:`AsyncMode` never blocks the event loop (its
sleep, ack wait and condition wait, on an ``asyncio.Event``, are awaited). The
ack waits live here and nowhere else in the engine.

A policy (attempts, spans, retries with backoff, durable acks, unwinding) is
written once as a plain generator, a *script*: it yields the leaf outcomes it
needs run and gets each one's value back, or its exception thrown in at the
``yield``. ``Mode.script`` makes an outcome of it, and the mode's driver loop
runs it: a sync run calls it, an async run awaits it. ``with`` blocks, ``try``
and loops inside a script read as ordinary code (a ``with`` around a ``yield``
stays open while the driver runs the call, so a span closes after the awaited
call, never before), and a step costs one generator, not a coroutine per
combinator. Scripts compose with ``yield from`` (:func:`retrying`).

A user's ``StopIteration`` (``next()`` on an empty iterator) must reach the agent as
itself, yet Python turns one leaving a generator or coroutine frame into
``RuntimeError`` with it as ``__cause__`` (PEP 479). So a user function is called in
the driver's own frame, never inside a coroutine of its own (:meth:`AsyncMode.call`);
the driver throws the object itself into the script, whose ``yield`` sees it (an
attempt's span records it); and when Python's ``RuntimeError`` of it leaves the
script, the driver raises the object instead (:func:`_handed_out`). An async
driver is a coroutine: its awaiter gets Python's ``RuntimeError``, as from any
``async def``.

Calls of one run may go on at once: tasks on one loop, or threads calling one sync
run. An async driver switches tasks only at an awaited leaf, so a script's code between
two yields (the bookkeeping: a step's index, a push, records, spans, metrics) never
interleaves with another call's. A sync run gives threads the same guarantee through
its :class:`SyncMode`: a script and the code around it run holding the run's
:class:`_Turn` (:meth:`SyncMode.drive`), which only the blocking leaves (the user's
function, a retry's sleep, the ack wait, a condition wait) let go of while they block.
So a script is written once, for one thread, whichever driver runs it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Generic, TypeVar

from saga_otel import _acks

T = TypeVar("T")
R = TypeVar("R")

# A policy as a generator: yields outcomes of its mode, receives their values, returns a T.
Script = Generator["Outcome[Any]", Any, T]


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` gives a coroutine to await: the one rule for picking the
    async path (tools, ``observed()``).

    True for an ``async def`` function or method, an object whose ``__call__`` is
    ``async def``, and a ``functools.partial`` of either.
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    if isinstance(fn, type) or inspect.isroutine(fn) or not callable(fn):
        return False  # calling a class builds an object; a plain function was judged above
    return inspect.iscoroutinefunction(type(fn).__call__)  # what a call runs, as Python does


def is_generator_callable(fn: object) -> bool:
    """Whether calling ``fn`` gives a generator (``def`` or ``async def`` with ``yield``):
    its body runs only when iterated, so as a tool its write would never happen."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if not (inspect.isroutine(fn) or isinstance(fn, type)) and callable(fn):
        fn = type(fn).__call__  # what a call runs
    return inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)


class Outcome(ABC, Generic[T]):
    """A computation that yields a ``T`` when its driver runs it."""

    @abstractmethod
    def map(self, fn: Callable[[T], R]) -> Outcome[R]:
        """Transform the value with a plain function."""


class Immediate(Outcome[T]):
    """An outcome that runs when called: ``value = outcome()``."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn

    def __call__(self) -> T:
        return self._fn()

    def map(self, fn: Callable[[T], R]) -> Immediate[R]:
        return Immediate(lambda: fn(self._fn()))


class Pending(Outcome[T]):
    """An outcome run by calling it and awaiting what the call gives:
    ``value = await outcome()``."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], Awaitable[T]]) -> None:
        self._fn = fn

    def __call__(self) -> Awaitable[T]:
        return self._fn()

    def map(self, fn: Callable[[T], R]) -> Pending[R]:
        async def run() -> R:
            return fn(await self._fn())

        return Pending(run)


def _immediate(o: Outcome[T]) -> Immediate[T]:
    if not isinstance(o, Immediate):
        raise TypeError(f"a sync outcome was continued with {o!r}: build it with the same Mode")
    return o


def _pending(o: Outcome[T]) -> Pending[T]:
    if not isinstance(o, Pending):
        raise TypeError(f"an async outcome was continued with {o!r}: build it with the same Mode")
    return o


class Signal(ABC):
    """Rung by whoever changes what a waiter's condition reads (see :meth:`Mode.until`).
    Made by the mode that waits on it."""

    __slots__ = ()

    @abstractmethod
    def ring(self) -> None:
        """Wake the waiters to read their condition again; never blocks."""


class _ThreadSignal(Signal):
    """A sync mode's: the ringer may be another thread."""

    __slots__ = ("cond",)

    def __init__(self) -> None:
        self.cond = threading.Condition()

    def ring(self) -> None:
        with self.cond:
            self.cond.notify_all()


class _LoopSignal(Signal):
    """An async mode's: the ringer is a task on the waiter's loop."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def ring(self) -> None:
        self.event.set()


class Mode(ABC):
    """Makes the leaf outcomes of one kind (sync or async), and runs scripts of them."""

    is_async: bool

    @abstractmethod
    def pure(self, value: T) -> Outcome[T]:
        """An outcome that yields ``value``."""

    @abstractmethod
    def run(self, fn: Callable[[], T]) -> Outcome[T]:
        """A plain function's call as an outcome (nothing awaited)."""

    @abstractmethod
    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Outcome[Any]:
        """Call a user function; in async mode an awaitable result is awaited. What it
        raises reaches the script as itself (a StopIteration too: see the module's doc)."""

    @abstractmethod
    def script(self, body: Callable[[], Script[T]]) -> Outcome[T]:
        """Run the generator ``body()`` makes (when the outcome runs, not before): each
        outcome it yields is run by this mode, its value sent back or its exception
        thrown in at the ``yield``; what the generator returns is the value. A loop of
        yields runs in one frame, however long."""

    @abstractmethod
    def sleep(self, seconds: float) -> Outcome[None]: ...

    @abstractmethod
    def ack(self, span: Any) -> Outcome[bool]:
        """Wait (bounded) until the sidecar acknowledged ``span``; never raises."""

    @abstractmethod
    def shield(self, o: Outcome[T]) -> Outcome[T]:
        """Run ``o`` to its end even if the caller is cancelled meanwhile; then the
        caller's cancellation propagates."""

    @abstractmethod
    def signal(self) -> Signal:
        """A signal for :meth:`until` in this mode."""

    @abstractmethod
    def until(self, done: Callable[[], bool], signal: Signal, timeout: float) -> Outcome[bool]:
        """Wait until ``done()`` holds, read again each time ``signal`` rings, at most
        ``timeout`` seconds: whether it holds. An interrupt or a cancellation propagates."""


def retrying(
    mode: Mode, attempts: int, delay: Callable[[int], float], body: Callable[[int], Script[T]]
) -> Script[T]:
    """The one retry loop, as a script to ``yield from``: ``body(n)`` for n = 1.. until
    it returns or ``attempts`` ran.

    Only :class:`Exception` is retried (an interrupt or a cancellation is not); the
    wait after failed attempt n is ``delay(n)``, slept through ``mode``. The last
    attempt's exception propagates unchanged.
    """
    n = 1
    while True:
        try:
            return (yield from body(n))
        except Exception:
            if n >= attempts:
                raise
        # Outside the except block: the next attempt's exception does not chain onto this one.
        yield mode.sleep(delay(n))
        n += 1


def _thrown_in(exc: BaseException, stops: list[StopIteration]) -> BaseException:
    """``exc``, to throw into the script as itself; a StopIteration is kept in ``stops``."""
    if isinstance(exc, StopIteration):
        stops.append(exc)
    return exc


def _handed_out(exc: RuntimeError, stops: list[StopIteration]) -> StopIteration | None:
    """The StopIteration of ``stops`` that ``exc`` is Python's RuntimeError of (it left a
    generator frame of the script: PEP 479), to raise in its place; else None."""
    cause = exc.__cause__
    if type(exc) is RuntimeError and isinstance(cause, StopIteration):
        for stop in stops:
            if stop is cause:
                return stop
    return None


class _Turn:
    """One run's turn to run its own code, in sync mode: a lock held by one thread at a
    time, taken again by the thread holding it (a callback of the run's own code, an
    escalation handler say, may call into the run), and let go of whole around a call
    that blocks (:meth:`released`), as a ``threading.Condition`` lets go of its lock
    while it waits.

    Ctrl-C may be raised in the main thread just after its ``acquire()`` took the lock,
    before the next line records it: every take asks the lock itself whether this
    thread holds it (an ``RLock``, which knows its owner; the turn counts its own depth)
    so an interrupt never leaves the lock held with no owner, nor waits on it again.
    """

    __slots__ = ("_depth", "_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None  # written only by the thread holding the lock
        self._depth = 0

    def _holds(self) -> bool:
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]  # as Condition asks

    def _take(self, me: int, depth: int) -> bool:
        """Take the lock; False if interrupted before it was taken. An interrupt raised
        just after it was taken is raised holding it, books set."""
        try:
            self._lock.acquire()
            self._owner, self._depth = me, depth
        except BaseException:
            if not self._holds():
                raise
            self._owner, self._depth = me, depth
            raise
        return True

    def __enter__(self) -> None:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return
        try:
            self._take(me, 1)
        except BaseException:
            if self._holds():  # taken, then interrupted: the block never ran, so let go
                self._owner, self._depth = None, 0
                self._lock.release()
            raise

    def __exit__(self, *_exc: object) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = None
            self._lock.release()

    def released(self, fn: Callable[[], T]) -> T:
        """``fn()`` with the turn let go of while it runs, when this thread holds it (else
        as it is: a mode no run drives, ``observed()``'s), and held again before this
        returns or raises."""
        me = threading.get_ident()
        if self._owner != me:
            return fn()
        depth = self._depth
        try:
            self._owner, self._depth = None, 0
            self._lock.release()
            return fn()
        finally:
            self._retake(me, depth)

    def _retake(self, me: int, depth: int) -> None:
        interrupt: BaseException | None = None
        while True:
            try:
                self._take(me, depth)
            except BaseException as exc:
                # Ctrl-C while another thread has the turn: raised once it is held again,
                # so the script sees it at its yield holding the turn, as it holds it there.
                interrupt = exc
                if not self._holds():
                    continue
            break
        if interrupt is not None:
            raise interrupt


class SyncMode(Mode):
    """Leaves that block the calling thread; run the result with ``outcome()``, or with
    :meth:`drive` when threads may share the run (every sync run's entry point does).

    The mode holds one :class:`_Turn`: :meth:`drive` takes it for the whole outcome, and
    the leaves that block (:meth:`call`, :meth:`sleep`, :meth:`ack`, :meth:`until`) let
    go of it while they block. So the code between two yields of a script runs whole, as
    between two awaits of an async run, while the tools of several threads run at once.
    """

    is_async = False

    def __init__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self._sleep = sleep
        self._turn = _Turn()

    def drive(self, make: Callable[[], Outcome[T]]) -> T:
        """Make an outcome and run it in the calling thread, holding the mode's turn
        (making it may change the run too: ``_Core.call`` admits the step there)."""
        with self._turn:
            return _immediate(make())()

    def _blocking(self, fn: Callable[[], T]) -> Immediate[T]:
        """A leaf that may block: run with the mode's turn let go of."""
        turn = self._turn
        return Immediate(lambda: turn.released(fn))

    def pure(self, value: T) -> Immediate[T]:
        return Immediate(lambda: value)

    def run(self, fn: Callable[[], T]) -> Immediate[T]:
        return Immediate(fn)

    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Immediate[Any]:
        return self._blocking(lambda: fn(*args, **kwargs))

    def script(self, body: Callable[[], Script[T]]) -> Immediate[T]:
        def run() -> T:
            gen = body()
            value: Any = None
            error: BaseException | None = None
            stops: list[StopIteration] = []  # the user's, thrown in: see _handed_out
            handed: StopIteration | None = None
            try:
                while True:
                    try:
                        step = gen.send(value) if error is None else gen.throw(error)
                    except StopIteration as stop:
                        result: T = stop.value
                        return result
                    except RuntimeError as exc:
                        handed = _handed_out(exc, stops)
                        if handed is None:
                            raise
                        break
                    finally:
                        error = None  # a raised error's traceback must not hold it in a cycle
                    try:
                        value = _immediate(step)()
                    except BaseException as exc:
                        value, error = None, _thrown_in(exc, stops)
            finally:
                stops.clear()  # each one's traceback holds this frame: no cycle through it
            try:
                raise handed  # outside the except block: the object as it was, nothing chained
            finally:
                del handed

        return Immediate(run)

    def sleep(self, seconds: float) -> Immediate[None]:
        return self._blocking(lambda: self._sleep(seconds))

    def ack(self, span: Any) -> Immediate[bool]:
        return self._blocking(lambda: _acks.wait_for_ack(span))

    def shield(self, o: Outcome[T]) -> Immediate[T]:
        return _immediate(o)  # nothing cancels a thread from outside

    def signal(self) -> _ThreadSignal:
        return _ThreadSignal()

    def until(self, done: Callable[[], bool], signal: Signal, timeout: float) -> Immediate[bool]:
        if not isinstance(signal, _ThreadSignal):
            raise TypeError(f"a sync wait was given {signal!r}: make it with the same Mode")
        cond = signal.cond

        def wait() -> bool:
            # done() is read under the condition's lock, and a ring takes it: a change
            # rung between the read and the wait is not missed. The turn is let go of,
            # so the threads whose end it waits for can record it (and ring).
            with cond:
                return bool(cond.wait_for(done, timeout))

        return self._blocking(wait)


async def _value(value: T) -> T:
    return value


class AsyncMode(Mode):
    """Leaves that await; run the result with ``await outcome()``. Nothing here blocks."""

    is_async = True

    def __init__(self, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._sleep = sleep

    def pure(self, value: T) -> Pending[T]:
        async def run() -> T:
            return value

        return Pending(run)

    def run(self, fn: Callable[[], T]) -> Pending[T]:
        async def run() -> T:
            return fn()

        return Pending(run)

    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Pending[Any]:
        # fn runs when the driver starts the outcome, in the driver's frame: a StopIteration
        # it raises is not made a RuntimeError by a coroutine of ours (PEP 479).
        def start() -> Awaitable[Any]:
            out = fn(*args, **kwargs)
            return out if inspect.isawaitable(out) else _value(out)

        return Pending(start)

    def script(self, body: Callable[[], Script[T]]) -> Pending[T]:
        async def run() -> T:
            gen = body()
            value: Any = None
            error: BaseException | None = None
            stops: list[StopIteration] = []  # the user's, thrown in: see _handed_out
            handed: StopIteration | None = None
            try:
                while True:
                    try:
                        step = gen.send(value) if error is None else gen.throw(error)
                    except StopIteration as stop:
                        result: T = stop.value
                        return result
                    except RuntimeError as exc:
                        handed = _handed_out(exc, stops)
                        if handed is None:
                            raise
                        break
                    finally:
                        error = None  # a raised error's traceback must not hold it in a cycle
                    try:
                        value = await _pending(step)()
                    except BaseException as exc:
                        # A cancellation too: the script's with blocks see it.
                        value, error = None, _thrown_in(exc, stops)
            finally:
                stops.clear()  # each one's traceback holds this frame: no cycle through it
            try:
                raise handed  # leaving this coroutine, Python makes it a RuntimeError (PEP 479)
            finally:
                del handed

        return Pending(run)

    def sleep(self, seconds: float) -> Pending[None]:
        async def run() -> None:
            await self._sleep(seconds)

        return Pending(run)

    def ack(self, span: Any) -> Pending[bool]:
        async def run() -> bool:
            return await _acks.wait_for_ack_async(span)

        return Pending(run)

    def shield(self, o: Outcome[T]) -> Pending[T]:
        inner = _pending(o)

        async def guarded() -> tuple[bool, Any]:
            # An interrupt must not escape a task (asyncio would re-raise it out of the
            # event loop itself): carry every outcome out as a value, raise it below.
            try:
                return True, await inner()
            except BaseException as exc:
                return False, exc

        async def run() -> T:
            task = asyncio.ensure_future(guarded())
            cancelled: asyncio.CancelledError | None = None
            while not task.done():
                try:
                    await asyncio.shield(task)
                except asyncio.CancelledError as exc:
                    # Our caller was cancelled; the shielded work goes on to its end.
                    cancelled = exc
            ok, value = task.result()
            if cancelled is not None and (
                ok or isinstance(value, Exception | asyncio.CancelledError)
            ):
                # Re-delivered once the work is done: asyncio.timeout and TaskGroup count on
                # the cancellation arriving, and the task must end cancelled. The work's
                # error stays in the chain. An interrupt from the work (KeyboardInterrupt,
                # SystemExit) still wins: it asks the process to stop, not the task.
                if not ok:
                    cancelled.__context__ = value
                raise cancelled
            if not ok:
                raise value
            result: T = value
            return result

        return Pending(run)

    def signal(self) -> _LoopSignal:
        return _LoopSignal()

    def until(self, done: Callable[[], bool], signal: Signal, timeout: float) -> Pending[bool]:
        if not isinstance(signal, _LoopSignal):
            raise TypeError(f"an async wait was given {signal!r}: make it with the same Mode")
        event = signal.event

        async def run() -> bool:
            try:
                async with asyncio.timeout(timeout):
                    while not done():
                        event.clear()  # one loop: nothing rings between the read and the wait
                        await event.wait()
            except TimeoutError:
                return done()
            return True

        return Pending(run)
