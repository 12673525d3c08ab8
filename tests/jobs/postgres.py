"""A real PostgreSQL for the job store's tests: a throwaway cluster in a temp folder on a free
port, started once per session, with a fresh database per test.

The server binaries are looked for where Debian puts them (/usr/lib/postgresql/<v>/bin), then
on PATH; missing, they are installed with `apt-get install -y postgresql` when that can run
(root, apt-get present). PostgreSQL refuses to run as root, so under root the cluster belongs to
the `postgres` system user (created if absent) and its programs run as that user. Durability is
off (fsync, synchronous_commit, full_page_writes): a crash loses the cluster, which is thrown
away anyway.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from debian_package import apt_install

PG_USER = "postgres"  # the database superuser name, and the system user under root
_START_TIMEOUT_S = 60


class Unavailable(Exception):
    """PostgreSQL cannot be had here; the message names what is missing."""


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))


_PROGRAMS = ("initdb", "pg_ctl", "postgres")


def find_bindir() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres: $GENGATE_PG_BINDIR, else the newest
    Debian version, else PATH's."""
    if configured := os.environ.get("GENGATE_PG_BINDIR"):
        folder = Path(configured)
        if not all((folder / name).is_file() for name in _PROGRAMS):
            raise Unavailable(f"GENGATE_PG_BINDIR={configured} does not hold {', '.join(_PROGRAMS)}")
        return folder
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    for folder in debian:
        if all((folder / name).is_file() for name in _PROGRAMS):
            return folder
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).resolve().parent
    return None


def install_server() -> str:
    """Installs the Debian `postgresql` package; returns why it could not ('' when it did)."""
    return apt_install("postgresql")


def _system_user() -> pwd.struct_passwd | None:
    """Who runs the cluster: None for this user, the `postgres` system user under root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        pass
    made = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
        capture_output=True,
        text=True,
    )
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        raise Unavailable(
            f"PostgreSQL will not run as root and the {PG_USER!r} user cannot be created: "
            f"{made.stderr.strip() or made.returncode}"
        ) from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PostgresServer:
    """A running throwaway cluster; `new_database()` for each test, `stop()` at the end."""

    bindir: Path
    root: Path
    port: int
    user: pwd.struct_passwd | None
    databases: list[str] = field(default_factory=list)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/{database}"

    def _run(self, program: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        extra: dict[str, Any] = {}
        if self.user is not None:  # drop root for the cluster's own programs
            extra = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        done = subprocess.run(
            [str(self.bindir / program), *args],
            capture_output=True,
            text=True,
            cwd=self.root,
            env={**os.environ, "LC_ALL": "C", "LANG": "C"},
            timeout=_START_TIMEOUT_S + 30,
            **extra,
        )
        if check and done.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{program} {' '.join(args)} failed:\n{done.stdout}{done.stderr}\n{tail}")
        return done

    def start(self) -> None:
        options = " ".join(
            [
                f"-p {self.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.root}",
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c max_connections=200",
                "-c shared_buffers=32MB",
            ]
        )
        self._run(
            "pg_ctl",
            "start",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-t",
            str(_START_TIMEOUT_S),
            "-o",
            options,
        )

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:16]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.databases.append(name)
        return self.url(name)

    def execute(self, url: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Runs one statement on the database at `url`; its rows (none for a statement without)."""
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            cur = conn.execute(sql, params)
            return list(cur.fetchall()) if cur.description is not None else []

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> PostgresServer:
    """A started cluster; Unavailable (naming what is missing) when PostgreSQL cannot be had."""
    bindir = find_bindir()
    if bindir is None:
        why = install_server()
        bindir = find_bindir()
        if bindir is None:
            raise Unavailable(
                "the PostgreSQL server binaries (initdb, pg_ctl, postgres) are not installed"
                + (f", and {why}" if why else ", and apt-get installed none")
            )
    user = _system_user()
    # Under the system temp folder (not pytest's, which is private to root).
    root = Path(tempfile.mkdtemp(prefix="gengate-pg-"))
    if user is not None:
        os.chown(root, user.pw_uid, user.pw_gid)
    last: Exception | None = None
    for _ in range(3):  # a free port can be taken between looking and binding: try another
        server = PostgresServer(bindir=bindir, root=root, port=_free_port(), user=user)
        try:
            if not server.data.exists():
                server._run(
                    "initdb", "-D", str(server.data), "-U", PG_USER, "-A", "trust", "-E", "UTF8",
                    "--locale=C", "--no-sync", "--no-instructions",
                )  # fmt: skip
            server.start()
            return server
        except RuntimeError as exc:
            last = exc
    shutil.rmtree(root, ignore_errors=True)
    raise RuntimeError(f"PostgreSQL did not start: {last}")
