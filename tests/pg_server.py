"""A real PostgreSQL server for the tests: initdb + pg_ctl into a temporary folder.

The server listens on 127.0.0.1 on a free port (its unix socket in the same
folder), requires a password (scram-sha-256: the tests grep output for it), and
runs as an unprivileged user when the tests run as root (initdb refuses root).
Each test gets a database of its own (:class:`Databases`), dropped afterwards.

Never skipped: without Debian's postgresql package the tests fail naming
``scripts/debian-deps``, which installs it.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg

MISSING = (
    "PostgreSQL's initdb/pg_ctl were not found (PATH, /usr/local/bin, "
    "/usr/lib/postgresql/*/bin): run scripts/debian-deps (as root it installs Debian's "
    "postgresql package, which the sidecar's PostgreSQL tests need)"
)
USER = "saga"


def pg_bin(name: str) -> str:
    """The path of a PostgreSQL server program, or an AssertionError naming the fix."""
    found = shutil.which(name) or shutil.which(name, path="/usr/local/bin")
    if found:
        return found
    versions = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if versions:
        return versions[-1]
    raise AssertionError(MISSING)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    """One server for the test session."""

    def __init__(self) -> None:
        initdb, self.pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
        # Not under pytest's basetemp: that is 0700 root's, and the server may run as nobody.
        self.root = Path(tempfile.mkdtemp(prefix="saga-pg-"))
        self.data = self.root / "data"
        self.password = "pw-" + secrets.token_hex(12)
        pwfile = self.root / "pwfile"
        pwfile.write_text(self.password + "\n")
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            uid = pwd.getpwnam("nobody").pw_uid
            os.chown(self.root, uid, -1)
            os.chown(pwfile, uid, -1)
            self.as_user = ["runuser", "-u", "nobody", "--"]
        self.port = _free_port()
        self._run(
            [
                initdb,
                "-D",
                str(self.data),
                "-U",
                USER,
                "--auth=scram-sha-256",
                f"--pwfile={pwfile}",
                "-E",
                "UTF8",
                "--no-sync",
            ]
        )
        pwfile.unlink()
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} "
            "-c fsync=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            [
                self.pg_ctl,
                "-D",
                str(self.data),
                "-l",
                str(self.root / "log"),
                "-w",
                "-t",
                "60",
                "-o",
                options,
                "start",
            ]
        )
        self._count = 0

    def _run(self, argv: list[str]) -> None:
        out = subprocess.run(
            [*self.as_user, *argv], capture_output=True, text=True, timeout=120, check=False
        )
        if out.returncode != 0:
            log = self.root / "log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise AssertionError(f"{argv[0]} failed ({out.returncode}): {out.stderr}{tail}")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{USER}:{self.password}@127.0.0.1:{self.port}/{dbname}"

    def create(self) -> str:
        """A new empty database; its URL."""
        self._count += 1
        name = f"t{os.getpid()}_{self._count}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def drop(self, name: str) -> None:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        subprocess.run(
            [*self.as_user, self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        shutil.rmtree(self.root, ignore_errors=True)


class Databases:
    """Databases of one test, one per SQLite path it names (so two "files" stay two)."""

    def __init__(self, server: PgServer) -> None:
        self.server = server
        self._by_path: dict[Path, str] = {}

    def url_for(self, path: Path) -> str:
        name = self._by_path.get(path)
        if name is None:
            name = self._by_path[path] = self.server.create()
        return self.server.url(name)

    def drop_all(self) -> None:
        for name in self._by_path.values():
            self.server.drop(name)
        self._by_path.clear()
