"""The fake world as a small real HTTP server, so an agent process, the
recovery process and the demo all see one ledger, one ticket system and one
mail service. Loopback only.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from examples.world import ServiceDown, World

_METHODS = {
    "issue_credit",
    "reverse_credit",
    "ticket_status",
    "set_ticket_status",
    "send_reply",
    "balance",
    "order",
    "state",
    "set_mail_down",
}


class _Handler(BaseHTTPRequestHandler):
    world: World

    def log_message(self, format: str, *args: Any) -> None:  # keep the demo's output clean
        return

    def do_POST(self) -> None:
        method = self.path.strip("/").removeprefix("call/")
        length = int(self.headers.get("Content-Length") or 0)
        if method not in _METHODS or length > 65536:
            self._send(404, {"error": f"no method {method!r}"})
            return
        kwargs = json.loads(self.rfile.read(length) or b"{}")
        w = self.world
        try:
            if method == "order":
                out: Any = w.orders[int(kwargs["order_id"])]
            elif method == "state":
                out = {"ledger": w.ledger, "tickets": w.tickets, "outbox": w.outbox}
            elif method == "set_mail_down":
                w.mail_down = bool(kwargs["down"])
                out = w.mail_down
            else:
                out = getattr(w, method)(**kwargs)
        except ServiceDown as exc:
            self._send(503, {"error": str(exc)})
            return
        self._send(200, {"result": out})

    def _send(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve_world(world: World, port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    handler = type("Handler", (_Handler,), {"world": world})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


class RemoteWorld:
    """The same methods as World, over HTTP."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.orders = _Orders(self)

    def _call(self, method: str, **kwargs: Any) -> Any:
        resp = httpx.post(f"{self.url}/call/{method}", json=kwargs, timeout=10.0)
        if resp.status_code == 503:
            raise ServiceDown(resp.json()["error"])
        resp.raise_for_status()
        return resp.json()["result"]

    def issue_credit(self, order_id: int, amount: int, key: str | None = None) -> Any:
        return self._call("issue_credit", order_id=order_id, amount=amount, key=key)

    def reverse_credit(self, credit_id: str, key: str | None = None) -> Any:
        return self._call("reverse_credit", credit_id=credit_id, key=key)

    def ticket_status(self, ticket_id: str) -> Any:
        return self._call("ticket_status", ticket_id=ticket_id)

    def set_ticket_status(self, ticket_id: str, status: str) -> Any:
        return self._call("set_ticket_status", ticket_id=ticket_id, status=status)

    def send_reply(self, ticket_id: str, body: str, key: str | None = None) -> Any:
        return self._call("send_reply", ticket_id=ticket_id, body=body, key=key)

    def balance(self, order_id: int) -> Any:
        return self._call("balance", order_id=order_id)

    def state(self) -> Any:
        return self._call("state")

    def set_mail_down(self, down: bool) -> Any:
        return self._call("set_mail_down", down=down)


class _Orders:
    def __init__(self, remote: RemoteWorld) -> None:
        self.remote = remote

    def __getitem__(self, order_id: int) -> dict[str, Any]:
        out: dict[str, Any] = self.remote._call("order", order_id=order_id)
        return out
