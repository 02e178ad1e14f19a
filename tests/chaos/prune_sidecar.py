"""A sidecar that prunes at once, for the kill-during-prune test (test_prune_kill.py).

  python prune_sidecar.py DB RETENTION_SECONDS

Serves on free loopback ports with the database DB (a SQLite file or a postgresql://
URL) and ``prune_interval`` 10 ms, so retention's prune starts right after the start;
prints ``{"event": "ready"}`` once it listens, then runs until killed or SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from sidecar import Settings, Sidecar


async def main(db: str, retention: float) -> None:
    url = "://" in db
    settings = Settings(
        otlp_http_port=0,
        otlp_grpc_port=0,
        api_port=0,
        retention=retention,
        prune_interval=0.01,
        db_path=None if url else Path(db),
        db_url=db if url else None,
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with Sidecar(settings):
        print(json.dumps({"event": "ready"}), flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
