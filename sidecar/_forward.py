"""Pass-through: re-export every accepted OTLP request to an upstream collector.

Intake never waits for the upstream: requests go into a bounded queue and a
background task sends them. A full queue or a failed send drops the request and
counts its spans, so a slow or dead upstream costs spans upstream, never intake.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from ._log import get_logger

log = get_logger("sidecar.forward")


@dataclass(frozen=True, slots=True)
class _Item:
    body: bytes
    content_type: str
    spans: int


class Forwarder:
    def __init__(
        self,
        url: str,
        *,
        queue_size: int,
        on_drop: Callable[[int], None],
        timeout: float = 10.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.url = url
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=queue_size)
        self._on_drop = on_drop
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._headers = headers or {}
        self.sent = 0
        self.dropped = 0
        self._down = False  # the upstream's last answer failed (logged once per outage)
        self._stopped = False  # run() ended: nothing offered now would ever be sent

    def offer(self, body: bytes, content_type: str, spans: int) -> bool:
        """Queue one request body; False (and counted) when the queue is full or the
        sender has stopped (a request answered while the sidecar shuts down)."""
        if self._stopped:
            self._drop(spans)
            return False
        try:
            self._queue.put_nowait(_Item(body, content_type, spans))
        except asyncio.QueueFull:
            self._drop(spans)
            return False
        return True

    def _drop(self, spans: int) -> None:
        self.dropped += spans
        self._on_drop(spans)

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    async def run(self) -> None:
        sending: _Item | None = None
        try:
            async with aiohttp.ClientSession(timeout=self._timeout) as session:
                while True:
                    sending = await self._queue.get()
                    await self._send(session, sending)
                    sending = None
        finally:
            # Whatever is lost upstream at shutdown is counted: the request cut mid-send,
            # what still waits in the queue, and (see offer) what comes after.
            self._stopped = True
            if sending is not None:
                self._drop(sending.spans)
            while not self._queue.empty():
                self._drop(self._queue.get_nowait().spans)

    async def _send(self, session: aiohttp.ClientSession, item: _Item) -> None:
        headers = {"Content-Type": item.content_type, **self._headers}
        try:
            async with session.post(self.url, data=item.body, headers=headers) as resp:
                await resp.read()
                if resp.status >= 300:
                    self._failed(f"answered {resp.status}", item.spans)
                    return
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._failed(f"{type(exc).__name__}: {exc}", item.spans)
            return
        if self._down:
            self._down = False
            log.info("sidecar.forward.up", url=self.url)
        self.sent += item.spans

    def _failed(self, why: str, spans: int) -> None:
        # Logged once when the upstream goes down (and once when it is back); each
        # dropped span is counted in the forward metric meanwhile.
        if not self._down:
            self._down = True
            log.warning("sidecar.forward.down", url=self.url, error=why, dropping=True)
        self._drop(spans)


async def cancel(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
