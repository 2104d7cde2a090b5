"""The demo's ``celery worker`` and ``celery beat`` subprocesses, each in its own process group.

A group holds a worker's main process and its pool children, so one signal stops,
resumes or kills the whole worker, as a host crash or a frozen VM would.
``Processes`` kills every group it started when its ``with`` block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

__all__ = ["Proc", "Processes", "ROOT"]

ROOT = Path(__file__).resolve().parent.parent
WORKER_FLAGS = ("--without-gossip", "--without-mingle", "--without-heartbeat")


class Proc:
    """One celery subprocess and its log file."""

    def __init__(self, name: str, popen: subprocess.Popen, log: Path) -> None:
        self.name, self.popen, self.log = name, popen, log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the whole process group (main process and pool children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stopped(self) -> bool:
        """Whether every process of the group is stopped (SIGSTOP has landed everywhere).

        Read from /proc; where there is none (not Linux) the answer is True: no way to tell.
        """
        proc = Path("/proc")
        if not proc.is_dir():
            return True
        for stat in proc.glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
                state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
                if int(pgrp) == self.pid and state not in ("T", "t", "Z", "X"):
                    return False
        return True

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class Processes:
    """Starts the demo's celery processes; kills all their groups on exit."""

    def __init__(self, app: str, log_dir: Path) -> None:
        self.app, self.log_dir = app, log_dir
        self.procs: list[Proc] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.kill_all()

    def kill_all(self) -> None:
        for proc in self.procs:
            proc.kill()

    def _spawn(self, name: str, args: list[str]) -> Proc:
        log = self.log_dir / f"{name}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", self.app, *args], cwd=ROOT, env=env,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def worker(self, name: str, queues: str, pool: str = "prefork", concurrency: int = 1) -> Proc:
        """``celery worker`` with node name ``name@%h``, consuming ``queues``."""
        return self._spawn(name, ["worker", "-n", f"{name}@%h", "-Q", queues, "-P", pool,
                                  "-c", str(concurrency), *WORKER_FLAGS, "-l", "INFO"])

    def beat(self, name: str = "beat") -> Proc:
        """``celery beat`` with its schedule file in the log directory."""
        return self._spawn(name, ["beat", "-s", str(self.log_dir / "beat-schedule"), "-l", "INFO"])
