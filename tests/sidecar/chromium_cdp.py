"""Headless Chromium (Debian's package) driven over the DevTools protocol, for page tests.

A small client on aiohttp's websocket: one browser process, one page target,
commands answered by id, events kept for whoever waits on them. Enough to load a
page, read what a person sees (``innerText``), fill and submit a form, answer an
HTTP auth prompt and take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class CdpError(Exception):
    """Chromium answered a command with an error, or did not start."""


class Chromium:
    """``async with Chromium(tmp_path) as page: await page.goto(url)``."""

    def __init__(
        self, profile: Path, *, width: int = 1280, height: int = 1000, args: tuple[str, ...] = ()
    ) -> None:
        """``args``: more command-line switches (e.g. ``--host-resolver-rules=...``)."""
        self.profile = profile
        self.args = args
        self.width = width
        self.height = height
        self.proc: subprocess.Popen[str] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._handlers: dict[str, Callable[[dict[str, Any]], None]] = {}
        self._loaded = asyncio.Event()
        self._stderr: list[str] = []

    async def __aenter__(self) -> Chromium:
        try:
            browser_ws = await asyncio.wait_for(asyncio.to_thread(self._launch), 60)
            port = int(browser_ws.split(":")[2].split("/")[0])
            self._session = aiohttp.ClientSession()
            async with self._session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            page = next(t for t in targets if t.get("type") == "page")
            self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
            self._reader = asyncio.create_task(self._read())
            await self.send("Page.enable")
            await self.send("Runtime.enable")
            await self.send(
                "Emulation.setDeviceMetricsOverride",
                width=self.width, height=self.height, deviceScaleFactor=1, mobile=False,
            )  # fmt: skip
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _launch(self) -> str:
        """Start the browser; its DevTools websocket URL once it listens."""
        self.proc = subprocess.Popen(
            [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-extensions", "--disable-dev-shm-usage",
                "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}", f"--window-size={self.width},{self.height}",
                *self.args, "about:blank",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        stderr = self.proc.stderr
        assert stderr is not None
        for line in stderr:
            self._stderr.append(line)
            match = _LISTENING.search(line)
            if match:
                threading.Thread(target=stderr.read, daemon=True).start()  # drain the rest
                return match.group(1)
        raise CdpError(f"chromium exited before listening: {''.join(self._stderr)[-2000:]}")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)

    async def _read(self) -> None:
        assert self._ws is not None
        async for msg in self._ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            method = data.get("method", "")
            if method == "Page.loadEventFired":
                self._loaded.set()
            handler = self._handlers.get(method)
            if handler is not None:
                handler(data.get("params", {}))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        msg_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        await self._ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        answer = await asyncio.wait_for(future, 60)
        if "error" in answer:
            raise CdpError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    def _fire(self, method: str, **params: Any) -> None:
        """A command sent from an event handler, its answer not awaited."""
        asyncio.get_running_loop().create_task(self.send(method, **params))

    async def answer_auth(self, user: str | None, password: str = "") -> None:
        """Answer every HTTP auth prompt from now on: a person typing the credentials,
        or (``user`` None) pressing Cancel, which shows the 401 page's own text."""
        answer = (
            {"response": "CancelAuth"}
            if user is None
            else {"response": "ProvideCredentials", "username": user, "password": password}
        )

        def paused(params: dict[str, Any]) -> None:
            self._fire("Fetch.continueRequest", requestId=params["requestId"])

        def auth(params: dict[str, Any]) -> None:
            self._fire(
                "Fetch.continueWithAuth",
                requestId=params["requestId"],
                authChallengeResponse=answer,
            )

        self._handlers["Fetch.requestPaused"] = paused
        self._handlers["Fetch.authRequired"] = auth
        await self.send("Fetch.enable", handleAuthRequests=True, patterns=[{"urlPattern": "*"}])

    async def _until_loaded(self, action: Any) -> None:
        self._loaded.clear()
        await action
        await asyncio.wait_for(self._loaded.wait(), 60)

    async def goto(self, url: str) -> None:
        await self._until_loaded(self.send("Page.navigate", url=url))

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise CdpError(f"{expression!r} raised {result['exceptionDetails']}")
        return result["result"].get("value")

    async def request(
        self, method: str, path: str, body: str = "", content_type: str = "text/plain"
    ) -> tuple[int, str]:
        """A request sent by a script of the page (a same-origin XHR): status and text."""
        send = json.dumps(body) if body else "null"
        script = (
            "(() => { const x = new XMLHttpRequest(); "
            f"x.open({json.dumps(method)}, {json.dumps(path)}, false); "
            f"x.setRequestHeader('Content-Type', {json.dumps(content_type)}); "
            f"x.send({send}); return [x.status, x.responseText]; }})()"
        )
        status, text = await self.evaluate(script)
        return int(status), str(text)

    async def text(self) -> str:
        """What a person sees: the page's rendered text."""
        value = await self.evaluate("document.body.innerText")
        return str(value)

    async def url(self) -> str:
        return str(await self.evaluate("location.href"))

    async def submit(self, form: str, fields: dict[str, str]) -> None:
        """Type into the form's fields and press its submit button; wait for the next page."""
        script = "".join(
            f"document.querySelector({json.dumps(form)}).elements[{json.dumps(k)}].value = "
            f"{json.dumps(v)};"
            for k, v in fields.items()
        )
        await self.evaluate(script)
        button = f"document.querySelector({json.dumps(form)}).querySelector('button').click()"
        await self._until_loaded(self.evaluate(button))

    async def screenshot(self, path: Path) -> Path:
        """The page down to the end of its content, as PNG (beyond the window when longer)."""
        height = int(
            await self.evaluate(
                "Math.ceil(document.body.lastElementChild.getBoundingClientRect().bottom) + 8"
            )
        )
        shot = await self.send(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": self.width, "height": max(height, 200), "scale": 1},
        )
        await asyncio.to_thread(_write, path, base64.b64decode(shot["data"]))
        return path


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
