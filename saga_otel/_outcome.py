"""Outcomes: a step's policy written once, run by a sync or an async driver.

An :class:`Outcome` is a not-yet-run computation. :class:`Immediate` wraps a
plain thunk and runs it when called; :class:`Pending` wraps a coroutine
function and runs it when awaited. Both compose the same way (``then``,
``map``, ``intercept``, ``also``), so the engine and ``observed()`` build one
outcome from one piece of policy code (attempts, spans, retries with backoff,
durable acks, unwinding) and the driver decides how it runs: a sync run calls
it, an async run awaits it.

A :class:`Mode` makes the leaves: calling a user function, sleeping between
retries, waiting for the sidecar's acknowledgement, shielding from
cancellation. :class:`SyncMode` blocks; :class:`AsyncMode` never blocks the
event loop (its sleep and ack wait are awaited). The ack waits live here and
nowhere else in the engine.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

from saga_otel import _acks

T = TypeVar("T")
R = TypeVar("R")
C = TypeVar("C")

Handler = Callable[[BaseException], "Outcome[T] | None"]


class Outcome(ABC, Generic[T]):
    """A computation that yields a ``T`` when its driver runs it."""

    @abstractmethod
    def then(self, fn: Callable[[T], Outcome[R]]) -> Outcome[R]:
        """Run ``fn(value)``'s outcome after this one (sequencing)."""

    @abstractmethod
    def map(self, fn: Callable[[T], R]) -> Outcome[R]:
        """Transform the value with a plain function."""

    @abstractmethod
    def intercept(
        self, handler: Handler[T], catch: type[BaseException] = BaseException
    ) -> Outcome[T]:
        """On an exception of type ``catch``: run ``handler(exc)``'s outcome instead,
        or re-raise the exception unchanged when the handler returns None."""

    @abstractmethod
    def also(self, cm: Callable[[], AbstractContextManager[Any]]) -> Outcome[T]:
        """Run inside a fresh context manager (its exit sees the body's exception)."""


class Immediate(Outcome[T]):
    """An outcome that runs when called: ``value = outcome()``."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn

    def __call__(self) -> T:
        return self._fn()

    def then(self, fn: Callable[[T], Outcome[R]]) -> Immediate[R]:
        return Immediate(lambda: _immediate(fn(self._fn()))())

    def map(self, fn: Callable[[T], R]) -> Immediate[R]:
        return Immediate(lambda: fn(self._fn()))

    def intercept(
        self, handler: Handler[T], catch: type[BaseException] = BaseException
    ) -> Immediate[T]:
        def run() -> T:
            try:
                return self._fn()
            except catch as exc:
                err = exc
            # Outside the except block: a retry's exception does not chain onto the last one.
            nxt = handler(err)
            if nxt is None:
                raise err
            return _immediate(nxt)()

        return Immediate(run)

    def also(self, cm: Callable[[], AbstractContextManager[Any]]) -> Immediate[T]:
        def run() -> T:
            with cm():
                return self._fn()

        return Immediate(run)


class Pending(Outcome[T]):
    """An outcome that runs when awaited: ``value = await outcome()``."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], Awaitable[T]]) -> None:
        self._fn = fn

    def __call__(self) -> Awaitable[T]:
        return self._fn()

    def then(self, fn: Callable[[T], Outcome[R]]) -> Pending[R]:
        async def run() -> R:
            return await _pending(fn(await self._fn()))()

        return Pending(run)

    def map(self, fn: Callable[[T], R]) -> Pending[R]:
        async def run() -> R:
            return fn(await self._fn())

        return Pending(run)

    def intercept(
        self, handler: Handler[T], catch: type[BaseException] = BaseException
    ) -> Pending[T]:
        async def run() -> T:
            try:
                return await self._fn()
            except catch as exc:
                err = exc
            nxt = handler(err)
            if nxt is None:
                raise err
            return await _pending(nxt)()

        return Pending(run)

    def also(self, cm: Callable[[], AbstractContextManager[Any]]) -> Pending[T]:
        async def run() -> T:
            # A plain ``with`` around the await: the span closes after the call, never before.
            with cm():
                return await self._fn()

        return Pending(run)


def _immediate(o: Outcome[T]) -> Immediate[T]:
    if not isinstance(o, Immediate):
        raise TypeError(f"a sync outcome was continued with {o!r}: build it with the same Mode")
    return o


def _pending(o: Outcome[T]) -> Pending[T]:
    if not isinstance(o, Pending):
        raise TypeError(f"an async outcome was continued with {o!r}: build it with the same Mode")
    return o


class Mode(ABC):
    """Makes the leaf outcomes of one kind (sync or async); the combinators below are shared."""

    is_async: bool

    @abstractmethod
    def pure(self, value: T) -> Outcome[T]:
        """An outcome that yields ``value``."""

    @abstractmethod
    def lazy(self, make: Callable[[], Outcome[T]]) -> Outcome[T]:
        """An outcome built only when it runs (so its preparation runs in order)."""

    @abstractmethod
    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Outcome[Any]:
        """Call a user function; in async mode an awaitable result is awaited."""

    @abstractmethod
    def within(
        self, cm: Callable[[], AbstractContextManager[C]], body: Callable[[C], Outcome[T]]
    ) -> Outcome[T]:
        """Run ``body(handle)``'s outcome inside a fresh ``with cm() as handle``."""

    @abstractmethod
    def each(self, items: Iterable[T], body: Callable[[T], Outcome[Any]]) -> Outcome[None]:
        """Run ``body(item)`` for each item, one after the other (a loop, not a chain,
        so a long run does not nest a frame per step)."""

    @abstractmethod
    def sleep(self, seconds: float) -> Outcome[None]: ...

    @abstractmethod
    def ack(self, span: Any) -> Outcome[bool]:
        """Wait (bounded) until the sidecar acknowledged ``span``; never raises."""

    @abstractmethod
    def shield(self, o: Outcome[T]) -> Outcome[T]:
        """Run ``o`` to its end even if the caller is cancelled meanwhile."""

    # -- written once on top of the leaves ------------------------------------
    def run(self, fn: Callable[[], T]) -> Outcome[T]:
        """A plain function's call as an outcome (nothing awaited)."""
        return self.pure(None).map(lambda _: fn())

    def retry(
        self,
        attempts: int,
        delay: Callable[[int], float],
        body: Callable[[int], Outcome[T]],
    ) -> Outcome[T]:
        """Run ``body(n)`` for n = 1.. until it succeeds or ``attempts`` ran.

        Only :class:`Exception` is retried (an interrupt or a cancellation is
        not); the wait after failed attempt n is ``delay(n)``, slept through
        this mode. The last attempt's exception propagates unchanged.
        """

        if attempts <= 1:  # nothing to retry: the body's outcome, built when it runs
            return self.lazy(lambda: body(1))

        def attempt(n: int) -> Outcome[T]:
            def failed(exc: BaseException) -> Outcome[T] | None:
                if n >= attempts or not isinstance(exc, Exception):
                    return None
                return self.sleep(delay(n)).then(lambda _: attempt(n + 1))

            return self.lazy(lambda: body(n)).intercept(failed)

        return attempt(1)


class SyncMode(Mode):
    """Leaves that block the calling thread; run the result with ``outcome()``."""

    is_async = False

    def __init__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self._sleep = sleep

    def pure(self, value: T) -> Immediate[T]:
        return Immediate(lambda: value)

    def lazy(self, make: Callable[[], Outcome[T]]) -> Immediate[T]:
        return Immediate(lambda: _immediate(make())())

    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Immediate[Any]:
        return Immediate(lambda: fn(*args, **kwargs))

    def within(
        self, cm: Callable[[], AbstractContextManager[C]], body: Callable[[C], Outcome[T]]
    ) -> Immediate[T]:
        def run() -> T:
            with cm() as handle:
                return _immediate(body(handle))()

        return Immediate(run)

    def each(self, items: Iterable[T], body: Callable[[T], Outcome[Any]]) -> Immediate[None]:
        def run() -> None:
            for item in items:
                _immediate(body(item))()

        return Immediate(run)

    def sleep(self, seconds: float) -> Immediate[None]:
        return Immediate(lambda: self._sleep(seconds))

    def ack(self, span: Any) -> Immediate[bool]:
        return Immediate(lambda: _acks.wait_for_ack(span))

    def shield(self, o: Outcome[T]) -> Immediate[T]:
        return _immediate(o)  # nothing cancels a thread from outside


class AsyncMode(Mode):
    """Leaves that await; run the result with ``await outcome()``. Nothing here blocks."""

    is_async = True

    def __init__(self, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._sleep = sleep

    def pure(self, value: T) -> Pending[T]:
        async def run() -> T:
            return value

        return Pending(run)

    def lazy(self, make: Callable[[], Outcome[T]]) -> Pending[T]:
        async def run() -> T:
            return await _pending(make())()

        return Pending(run)

    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Pending[Any]:
        async def run() -> Any:
            out = fn(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out

        return Pending(run)

    def within(
        self, cm: Callable[[], AbstractContextManager[C]], body: Callable[[C], Outcome[T]]
    ) -> Pending[T]:
        async def run() -> T:
            with cm() as handle:
                return await _pending(body(handle))()

        return Pending(run)

    def each(self, items: Iterable[T], body: Callable[[T], Outcome[Any]]) -> Pending[None]:
        async def run() -> None:
            for item in items:
                await _pending(body(item))()

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
            while not task.done():
                try:
                    await asyncio.shield(task)
                except asyncio.CancelledError:
                    # Our caller was cancelled; the shielded work goes on to its end.
                    continue
            ok, value = task.result()
            if not ok:
                raise value
            result: T = value
            return result

        return Pending(run)
