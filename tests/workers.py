"""Real ``celery worker`` / ``celery beat`` subprocesses for integration and chaos tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Proc:
    """A celery subprocess in its own process group, with its log file."""

    def __init__(self, popen: subprocess.Popen, log: Path, name: str) -> None:
        self.popen, self.log, self.name = popen, log, name

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def exited(self) -> int | None:
        """The exit code when the process has ended, else None."""
        return self.popen.poll()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _spawn(args: list[str], env: Mapping[str, str], log_dir: Path, name: str,
           wrapper: tuple[str, ...] = ()) -> Proc:
    log = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    handle = open(log, "wb")  # noqa: SIM115 - owned by the subprocess for its lifetime
    popen = subprocess.Popen(
        [*wrapper, sys.executable, "-m", "celery", *args], cwd=ROOT, env=full_env, stdout=handle,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    handle.close()
    return Proc(popen, log, name)


@contextlib.contextmanager
def celery_processes(log_dir: Path) -> Iterator[list[Proc]]:
    """Collect spawned processes and kill their process groups however the test ends."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()


def worker(app: str, env: Mapping[str, str], log_dir: Path, *, pool: str = "prefork",
           concurrency: int = 1, queues: str | None = None, name: str | None = None,
           extra: tuple[str, ...] = (), wrapper: tuple[str, ...] = ()) -> Proc:
    """Start ``celery -A app worker``; the node name is unique per call.

    ``wrapper`` prefixes the command with one that execs it (``ip netns exec NS``), so the
    process group is still the worker's own.
    """
    node = name or f"w{uuid.uuid4().hex[:6]}"
    args = ["-A", app, "worker", "-P", pool, "-c", str(concurrency), "-n", f"{node}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO", *extra]
    if queues:
        args += ["-Q", queues]
    return _spawn(args, env, log_dir, node, wrapper)


def beat(app: str, env: Mapping[str, str], log_dir: Path, name: str = "beat") -> Proc:
    """Start ``celery -A app beat`` with a schedule file of its own in ``log_dir``.

    Two beats sharing one shelve file race on its rewrite, and the loser exits at start-up.
    """
    return _spawn(["-A", app, "beat", "-l", "INFO", "-s", str(log_dir / f"{name}-schedule")],
                  env, log_dir, name)
