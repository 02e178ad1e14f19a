"""A raw HTTP alert receiver on loopback: keeps every byte each POST carried."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class RawReceiver:
    """Answers 200 to any POST (webhook, Alertmanager's /api/v2/alerts, PagerDuty)."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    outer.bodies.append((self.path, body))
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def raw(self) -> bytes:
        with self.lock:
            return b"\n".join(body for _, body in self.bodies)

    def docs(self) -> list[Any]:
        """Each body parsed; an Alertmanager body (a list) is flattened to its alerts."""
        out: list[Any] = []
        with self.lock:
            for _, body in self.bodies:
                doc = json.loads(body)
                out.extend(doc if isinstance(doc, list) else [doc])
        return out

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
