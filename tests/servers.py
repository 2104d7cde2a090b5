"""Private database and broker servers that a crash test starts, kills and restarts itself.

Never the shared servers on 5432/6379: each server here runs on a free port in a directory of
the test's own, and the test may SIGKILL it. PostgreSQL: ``initdb`` refuses root, so every
server command runs as ``postgres`` through ``runuser``; trust authentication on 127.0.0.1, no
Unix socket. A SIGKILLed postmaster's children must be reaped before the data directory can be
started again, so this process becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``) and reaps
what it inherits. Redis: ``--save "" --appendonly no``, so a SIGKILL empties the broker.

A missing binary skips the test with a reason naming it, or fails it when
``CELERY_LEASE_REQUIRE_SERVICES`` is set (as ``tests/conftest.py``'s ``require_service`` does).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.helpers import poll

PR_SET_CHILD_SUBREAPER = 36
PG_USER = "postgres"
# A killed server loses nothing that reached the kernel, fsync or not: the tests kill processes,
# never the machine. With fsync on, crash recovery first fsyncs the whole data directory, which
# took 3 s on a busy shared disk (more than half a test's lease); fsync off skips that.
PG_DEFAULTS = {"fsync": "off"}
START_TIMEOUT = 30  # seconds pg_ctl waits for a server to accept connections


def _missing(what: str) -> NoReturn:
    reason = f"{what} not found: the crash tests start servers of their own"
    if os.environ.get("CELERY_LEASE_REQUIRE_SERVICES"):
        pytest.fail(f"{reason} (CELERY_LEASE_REQUIRE_SERVICES is set)", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_subreaper(on: bool) -> None:
    """Adopt orphaned descendants (a killed postmaster's backends) so they can be reaped here."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def reap(pids: list[int]) -> None:
    """Collect those of ``pids`` that are exited children of this process (non-blocking)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def reap_zombies() -> None:
    """Collect every exited child of this process (non-blocking): the orphans it adopted."""
    with contextlib.suppress(ChildProcessError):
        while True:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return


def pg_bin_dir() -> Path:
    """``/usr/lib/postgresql/<version>/bin`` of the newest installed version."""
    root = Path("/usr/lib/postgresql")
    versions = sorted((p for p in root.glob("*/bin/initdb")), key=lambda p: int(p.parent.parent.name))
    if not versions or shutil.which("runuser") is None:
        _missing("PostgreSQL's initdb (/usr/lib/postgresql/*/bin/initdb) or runuser")
    return versions[-1].parent


class PostgresServer:
    """One private PostgreSQL cluster: a data directory, a port, and its server processes."""

    def __init__(self, base: Path, name: str = "pg", port: int | None = None) -> None:
        self.bin = pg_bin_dir()
        self.dir = base / name
        self.log = base / f"{name}.log"
        self.port = port or free_port()

    # -- commands, run as postgres ----------------------------------------------------------------
    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["runuser", "-u", PG_USER, "--", str(self.bin / tool), *args],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if check and done.returncode:
            raise RuntimeError(f"{tool} {' '.join(args)} exited {done.returncode}: "
                               f"{done.stderr.strip() or done.stdout.strip()}\n{self.log_text()[-2000:]}")
        return done

    def _own(self) -> None:
        """The data directory's parent and the log file belong to postgres."""
        shutil.chown(self.dir.parent, PG_USER)
        self.log.touch()
        shutil.chown(self.log, PG_USER)

    def init(self, **settings: str) -> PostgresServer:
        """``initdb`` with trust authentication, then ``settings`` appended to postgresql.conf."""
        self._own()
        self._run("initdb", "-D", str(self.dir), "-A", "trust", "-U", PG_USER, "--no-sync")
        self.configure(**{**PG_DEFAULTS, **settings})
        return self

    def configure(self, **settings: str) -> None:
        """Append ``name = 'value'`` lines to postgresql.conf (read at the next start or reload)."""
        with open(self.dir / "postgresql.conf", "a") as conf:
            for name, value in settings.items():
                conf.write(f"{name} = '{value}'\n")

    def start(self) -> float:
        """Start the server and wait until it accepts connections; returns the seconds it took."""
        began = time.monotonic()
        self._run("pg_ctl", "-D", str(self.dir), "-l", str(self.log), "-w", "-t", str(START_TIMEOUT),
                  "-o", f"-p {self.port} -k '' -c listen_addresses=127.0.0.1", "start")
        return time.monotonic() - began

    def kill(self) -> list[int]:
        """SIGKILL the postmaster and every backend at once, and reap them; returns their pids."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        poll(lambda: reap(pids) or not any(_alive(pid) or _zombie_child(pid) for pid in pids), 10, 0.01)
        return pids

    def pids(self) -> list[int]:
        """The postmaster and its children (backends, walsender, checkpointer, ...), alive."""
        pidfile = self.dir / "postmaster.pid"
        try:
            postmaster = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return []
        children = [int(p) for p in _children(postmaster)]
        return [pid for pid in [postmaster, *children] if _alive(pid)]

    def stop(self) -> None:
        """Stop it now, however it is (the test's end)."""
        if self.pids():
            self._run("pg_ctl", "-D", str(self.dir), "-m", "immediate", "-w", "stop", check=False)
        self.kill()

    def promote(self) -> float:
        """``pg_ctl promote`` a standby and wait until it takes writes; returns the seconds it took."""
        began = time.monotonic()
        self._run("pg_ctl", "-D", str(self.dir), "-w", "-t", str(START_TIMEOUT), "promote")
        return time.monotonic() - began

    def standby_of(self, primary: PostgresServer) -> PostgresServer:
        """Make this directory a streaming standby of ``primary`` (``pg_basebackup -R``)."""
        self._own()
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", PG_USER,
                  "-D", str(self.dir), "-R", "-X", "stream", "--no-sync", "-c", "fast")
        return self

    def sql(self, statement: str, db: str = "postgres") -> str:
        """Run one statement through psql; its unaligned output."""
        return self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER, "-d", db,
                         "-Atc", statement).stdout.strip()

    def url(self, db: str = "postgres") -> str:
        return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{self.port}/{db}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _children(pid: int) -> list[str]:
    """Every live descendant of ``pid`` (read from /proc/*/stat's ppid field)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(str(child))
            todo.append(child)
    return found


def _zombie_child(pid: int) -> bool:
    """Whether ``pid`` is a zombie whose parent is this process (so it waits for our reaping)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] == "Z" and int(fields[1]) == os.getpid()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class RedisServer:
    """A private redis-server without persistence: a SIGKILL loses every message it held."""

    def __init__(self, base: Path, name: str = "redis", port: int | None = None) -> None:
        self.binary = shutil.which("redis-server") or _missing("redis-server")
        self.base, self.name = base, name
        self.log = base / f"{name}.log"
        self.port = port or free_port()
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it on its port (the same one after a kill) and wait until it answers PING."""
        import redis

        began = time.monotonic()
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(
                [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.base)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        try:
            def state() -> str | None:
                try:
                    client.ping()
                    return "up"
                except redis.ConnectionError:
                    return "exited" if self.popen.poll() is not None else None

            if poll(state, 10, 0.02) != "up":
                raise RuntimeError(f"redis-server on {self.port} did not answer: "
                                   f"{self.log.read_text(errors='replace')[-1000:]}")
        finally:
            client.close()
        return time.monotonic() - began

    def kill(self) -> None:
        """SIGKILL it and wait for it (no persistence: it comes back empty)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self) -> None:
        self.kill()

    def client(self):
        """A redis-py client of this server."""
        import redis

        return redis.Redis(port=self.port, socket_connect_timeout=2, socket_timeout=5)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"


class Servers:
    """The private servers of one test, in a directory of their own that ``postgres`` can reach.

    The data directories go under a fresh ``/tmp`` directory (pytest's ``tmp_path`` sits under a
    root-only directory), removed at the end; their logs are copied to ``log_dir`` first.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.base = Path(tempfile.mkdtemp(prefix="celery-lease-crash-"))
        self.base.chmod(0o755)
        self.started: list[PostgresServer | RedisServer] = []

    def postgres(self, name: str = "pg", **settings: str) -> PostgresServer:
        """A new cluster (``initdb``, then ``settings`` in postgresql.conf), started."""
        server = PostgresServer(self.base, name).init(**settings)
        self.started.append(server)
        server.start()
        return server

    def standby(self, primary: PostgresServer, name: str = "standby", **settings: str) -> PostgresServer:
        """A streaming standby of ``primary`` (``pg_basebackup -R``), with ``settings``, started."""
        server = PostgresServer(self.base, name).standby_of(primary)
        server.configure(**settings)
        self.started.append(server)
        server.start()
        return server

    def redis(self) -> RedisServer:
        server = RedisServer(self.base)
        self.started.append(server)
        server.start()
        return server

    def close(self) -> None:
        for server in reversed(self.started):
            with contextlib.suppress(Exception):
                server.stop()
        reap_zombies()
        for log in self.base.glob("*.log"):
            with contextlib.suppress(OSError):
                shutil.copy(log, self.log_dir / log.name)
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def servers(log_dir: Path) -> Iterator[Servers]:
    """Private servers that are stopped, reaped and removed however the test ends."""
    set_subreaper(True)
    own = Servers(log_dir)
    try:
        yield own
    finally:
        own.close()
        set_subreaper(False)  # later tests' orphans go to init again, as they would without us
        reap_zombies()
