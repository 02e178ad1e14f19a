"""A raw-socket HTTP/1.1 load generator for the OTLP/HTTP intake benches.

An aiohttp client tops out near 1,200 single-span requests/s on one core, below
what the parse-only reference serves, so it measured itself. This one keeps
``concurrency`` keep-alive connections, each with one request in flight (no
pipelining: the server sees what an exporter sends), prebuilt request bytes, and
an epoll loop that parses only the status line and Content-Length.
"""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Sequence


def request_bytes(port: int, body: bytes, path: str = "/v1/traces") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/x-protobuf\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Conn:
    __slots__ = ("buf", "out", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = memoryview(b"")
        self.buf = bytearray()


def _complete(buf: bytearray) -> int:
    """Bytes of the first full response in ``buf`` (0: not yet); raises on a non-200."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return 0
    head = bytes(buf[:end]).decode("latin-1")
    status = head[9:12]
    if status != "200":
        raise RuntimeError(f"server answered {head.splitlines()[0]!r}")
    length = 0
    for line in head.split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
            break
    total = end + 4 + length
    return total if len(buf) >= total else 0


def drive(
    port: int | Sequence[int],
    bodies: Sequence[bytes],
    concurrency: int = 8,
    rate: float | None = None,
) -> float:
    """POST every body (``concurrency`` connections, one request each in flight); seconds.

    Several ports (sidecar replicas): the connections are spread over them in turn.

    With ``rate``, request ``i`` is not sent before ``i / rate`` seconds from the start
    (a paced background load); without it, as fast as the server answers.
    """
    ports = [port] if isinstance(port, int) else list(port)
    requests = [request_bytes(ports[0], b) for b in bodies]
    queue = list(reversed(requests))
    sel = selectors.DefaultSelector()
    conns = []
    for i in range(min(concurrency, len(requests))):
        sock = socket.create_connection(("127.0.0.1", ports[i % len(ports)]))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        conns.append(_Conn(sock))
    outstanding = 0
    started = time.perf_counter()
    sent_count = 0
    idle: list[_Conn] = []

    def send_next(conn: _Conn) -> bool:
        nonlocal sent_count
        if not queue:
            return False
        if rate is not None and time.perf_counter() < started + sent_count / rate:
            idle.append(conn)
            return False
        sent_count += 1
        conn.out = memoryview(queue.pop())
        sent = conn.sock.send(conn.out)
        conn.out = conn.out[sent:]
        sel.register(conn.sock, selectors.EVENT_WRITE if conn.out else selectors.EVENT_READ, conn)
        return True

    try:
        for conn in conns:
            if send_next(conn):
                outstanding += 1
        while outstanding or idle:
            timeout = None
            if idle:
                assert rate is not None
                timeout = max(0.0, started + sent_count / rate - time.perf_counter())
                if timeout == 0.0:
                    waiting, idle[:] = list(idle), []
                    for conn in waiting:
                        if send_next(conn):
                            outstanding += 1
                    continue
            for key, events in sel.select(timeout):
                conn = key.data
                if events & selectors.EVENT_WRITE:
                    sent = conn.sock.send(conn.out)
                    conn.out = conn.out[sent:]
                    if not conn.out:
                        sel.modify(conn.sock, selectors.EVENT_READ, conn)
                    continue
                chunk = conn.sock.recv(65536)
                if not chunk:
                    raise RuntimeError("server closed a keep-alive connection")
                conn.buf += chunk
                done = _complete(conn.buf)
                if not done:
                    continue
                del conn.buf[:done]
                sel.unregister(conn.sock)
                outstanding -= 1
                if send_next(conn):
                    outstanding += 1
        return time.perf_counter() - started
    finally:
        sel.close()
        for conn in conns:
            conn.sock.close()
