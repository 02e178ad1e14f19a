"""An unpaced background load that keeps the sidecar's intake busy, in its own process.

Requests of RUNS_PER_REQUEST complete runs (a ``do`` span with a compensation and
the ``run`` span, ``completed``), every run new, so nothing deduplicates and
nothing is left open to idle into an orphan. Bodies come from one protobuf
template whose fresh ids are joined in place (about 35 us a request, against
~200 us to build one with protobuf), sent by bench/_loadgen.py's raw-socket
driver on CONNECTIONS keep-alive connections (32: as many exporters, each with
a request in flight, so the sidecar always has a backlog) with no pacing: as
fast as the sidecar answers. Run as ``python -m bench._saturate PORT SEED``; it
prints ``ready`` when it starts sending and, at SIGTERM, one JSON line with
what it sent.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time

from bench._loadgen import drive
from bench._spans import T0_NS, do_span, new_request, saga_span
from saga_otel import semconv as sc

RUNS_PER_REQUEST = 10
SPANS_PER_REQUEST = 2 * RUNS_PER_REQUEST
CHUNK = 400  # requests per drive() call: a few tenths of a second of load
CONNECTIONS = 32


class Bodies:
    """Distinct requests from one template: run ``n`` of request ``i`` gets fresh ids."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        # Random 128/64-bit sentinels: their bytes appear nowhere else in the template.
        self._runs = [rng.getrandbits(127) | (1 << 126) for _ in range(RUNS_PER_REQUEST)]
        self._spans = [rng.getrandbits(63) | (1 << 62) for _ in range(SPANS_PER_REQUEST)]
        req, spans = new_request()
        for k, run in enumerate(self._runs):
            do_span(spans, run, 0, 0, "issue_credit")  # counter 0: the span id is set below
            spans[-1].span_id = self._spans[2 * k].to_bytes(8, "big")  # type: ignore[index]
            saga_span(
                spans,
                run,
                self._spans[2 * k + 1],
                sc.run_span_name("refund"),
                T0_NS,
                T0_NS + 1000,
                (
                    (sc.SAGA_RUN_ID, f"{run:032x}"),
                    (sc.SAGA_NAME, "refund"),
                    (sc.SAGA_PHASE, sc.PHASE_RUN),
                    (sc.SAGA_RUN_STATUS, sc.STATUS_COMPLETED),
                ),
                ((sc.SAGA_CONTRACT_VERSION, 1),),
            )
        template = req.SerializeToString()
        # Where each sentinel sits: the body is the template's other bytes joined with
        # the fresh ids in those places (one join a request, no scan).
        needles = (
            [("trace", k, r.to_bytes(16, "big")) for k, r in enumerate(self._runs)]
            + [("hex", k, f"{r:032x}".encode()) for k, r in enumerate(self._runs)]
            + [("span", k, s.to_bytes(8, "big")) for k, s in enumerate(self._spans)]
        )
        places: list[tuple[int, int, str, int]] = []
        for kind, k, needle in needles:
            at = template.find(needle)
            while at >= 0:
                places.append((at, len(needle), kind, k))
                at = template.find(needle, at + 1)
        places.sort()
        self._pieces: list[bytes] = []
        self._slots: list[tuple[str, int]] = []
        last = 0
        for at, size, kind, k in places:
            self._pieces.append(template[last:at])
            self._slots.append((kind, k))
            last = at + size
        self._pieces.append(template[last:])
        self._base = seed << 80
        self.made = 0

    def next(self) -> bytes:
        i = self.made
        self.made += 1
        runs = [self._base + i * RUNS_PER_REQUEST + k + 1 for k in range(RUNS_PER_REQUEST)]
        fresh = {
            "trace": [r.to_bytes(16, "big") for r in runs],
            "hex": [f"{r:032x}".encode() for r in runs],
            "span": [
                (((i * SPANS_PER_REQUEST + k + 1) << 8) | 1).to_bytes(8, "big")
                for k in range(SPANS_PER_REQUEST)
            ],
        }
        out = [self._pieces[0]]
        for (kind, k), piece in zip(self._slots, self._pieces[1:], strict=True):
            out.append(fresh[kind][k])
            out.append(piece)
        return b"".join(out)


USAGE = "usage: python -m bench._saturate PORT SEED (SEED: 1..65535, one per load run)"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not all(a.isascii() and a.isdigit() for a in argv):
        print(f"{USAGE}; got {argv!r}", file=sys.stderr)
        return 2
    port, seed = int(argv[0]), int(argv[1])
    if not (0 < port < 65536 and 0 < seed < 65536):
        print(f"{USAGE}; got port {port}, seed {seed}", file=sys.stderr)
        return 2
    bodies = Bodies(seed)  # distinct seeds, distinct run ids: no load repeats another's
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    started = time.perf_counter()
    sent = 0
    while not stopping:
        chunk = [bodies.next() for _ in range(CHUNK)]
        drive(port, chunk, CONNECTIONS)
        sent += len(chunk)
    seconds = time.perf_counter() - started
    print(json.dumps({"spans": sent * SPANS_PER_REQUEST, "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
