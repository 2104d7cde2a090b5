"""Run Celery's own integration tests with every task a LeaseTask, compared with plain Celery.

    python tools/celery_suite/run.py [--subset ci] [--record] [PYTEST ARGS...]

The Makefile calls it (``make test-celery``, ``make test-celery-ci``,
``make test-celery-baseline``) with the project's venv, whose Celery version it tests:

1. fetches that version's sdist from PyPI (``pip download --no-binary :all:``) and unpacks its
   tests (``t/``, the pytest settings and the requirements) under ``.cache/celery-suite/``;
2. builds ``.venv-celery``: this checkout installed editable, that Celery, and the pytest
   plugins at the versions Celery's own test requirements pin (reruns for @flaky, timeouts);
3. runs test_tasks, test_canvas, test_inspect and test_group_chains from the sdist with
   tools/celery_suite/plugin.py, which makes ``celery_lease:LeaseTask`` every app's task class
   (``CELERY_SUITE_TASK_CLS=plain``: Celery's own Task), and compares the outcome with the
   pass list of plain Celery for that version (``pass-<version>.txt`` beside this file);
   ``--record`` (plain mode) writes that list instead.

Broker and result backend: ``TEST_BROKER`` / ``TEST_BACKEND`` as in Celery's conftest, here by
default the local Redis, databases 1 and 2 (no test of the project uses them). Celery's tasks
also keep counters in Redis database 0 (``REDIS_HOST`` / ``REDIS_PORT``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CACHE = ROOT / ".cache" / "celery-suite"
VENV = ROOT / ".venv-celery"
SUITE = (
    "t/integration/test_tasks.py",
    "t/integration/test_canvas.py",
    "t/integration/test_inspect.py",
    "t/integration/test_group_chains.py",
)
#: What the sdist contributes: the tests, the pytest settings (markers, test_* classes,
#: strict xfail) and the requirements. Celery itself comes from the venv, never from the sdist.
UNPACKED = ("t/", "pyproject.toml", "requirements/")
#: Pytest and its plugins at the versions Celery's requirements/test.txt pins.
CELERY_TEST_TOOLS = ("pytest", "pytest-rerunfailures", "pytest-timeout", "pytest-subtests")
#: Packages Celery's integration tasks import, beyond Celery and the project.
SUITE_EXTRAS = ("redis", "pydantic", "tblib")
#: Celery's own CI runs its integration tests with the worker logging at INFO (test_trace_log_arguments
#: reads those records).
DEFAULTS = {"TEST_BROKER": "redis://127.0.0.1:6379/1", "TEST_BACKEND": "redis://127.0.0.1:6379/2",
            "WORKER_LOGLEVEL": "INFO"}
#: ``--subset ci``: the tests CI has time for (README, "Running the tests"): replace, chains,
#: chords, groups, retries and revoke, without the four chord tests that spend about six
#: minutes waiting out timeouts on purpose (allow_error_cb_on_chord_header, and one xfail).
CI_SUBSET = ("(replace or chain or chord or group or retry or revoke) "
             "and not allow_error_cb_on_chord_header and not error_propagates_from_chord")
#: Tests that pass with plain Celery and, on purpose, not with LeaseTask (README).
DIFFERENCES = HERE / "differences.txt"
#: Tests whose race is in the test itself: rerun as Celery's @flaky ones, in both modes (README).
RACY = HERE / "racy.txt"


def pass_list(version: str) -> Path:
    return HERE / f"pass-{version}.txt"


def fetch_sdist(version: str) -> Path:
    """The unpacked tests of Celery ``version`` (downloaded once into the cache)."""
    target = CACHE / f"celery-{version}"
    if (target / ".unpacked").exists():
        return target
    downloads = CACHE / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    archive = downloads / f"celery-{version}.tar.gz"
    if not archive.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", "--dest", str(downloads), f"celery=={version}"], check=True)
    shutil.rmtree(target, ignore_errors=True)
    with tarfile.open(archive) as tar:
        top = f"celery-{version}/"
        members = [m for m in tar.getmembers()
                   if m.name.startswith(top) and m.name[len(top):].startswith(UNPACKED)]
        for member in members:
            member.name = member.name[len(top):]
        extract = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(target, members=members, **extract)  # noqa: S202 - members filtered above
    (target / ".unpacked").write_text(f"{archive.name}\n")
    return target


def celery_test_tools(sdist: Path) -> list[str]:
    """The lines of Celery's requirements/test.txt that pin pytest and the plugins the suite uses."""
    wanted = []
    for line in (sdist / "requirements" / "test.txt").read_text().splitlines():
        name = line.split(";")[0].split("==")[0].split(">=")[0].split("[")[0].strip().lower()
        if name in CELERY_TEST_TOOLS:
            wanted.append(line.strip())
    return wanted


def ensure_venv(version: str, sdist: Path) -> Path:
    """``.venv-celery`` with this checkout (editable), Celery ``version`` and the test tools."""
    python = VENV / "bin" / "python"
    requirements = [f"celery[redis]=={version}", *SUITE_EXTRAS, *celery_test_tools(sdist)]
    fingerprint = hashlib.sha256("\n".join([
        *requirements, (ROOT / "setup.cfg").read_text(), (ROOT / "pyproject.toml").read_text(),
    ]).encode()).hexdigest()
    stamp = VENV / ".installed"
    if python.exists() and stamp.exists() and stamp.read_text().strip() == fingerprint:
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[redis,postgres]", *requirements], check=True)
    stamp.write_text(fingerprint + "\n")
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--celery-version", help="default: the Celery installed with this Python")
    parser.add_argument("--subset", choices=("ci",), help="run CI's subset instead of every test")
    parser.add_argument("--record", action="store_true",
                        help="write the pass list of this version (with CELERY_SUITE_TASK_CLS=plain)")
    parser.add_argument("--with-differences", action="store_true",
                        help="run the known differences (differences.txt) too; they then fail the run")
    args, pytest_args = parser.parse_known_args(argv)
    mode = os.environ.get("CELERY_SUITE_TASK_CLS", "lease")
    version = args.celery_version or metadata.version("celery")
    if args.record and mode != "plain":
        parser.error("--record writes plain Celery's pass list: set CELERY_SUITE_TASK_CLS=plain")
    expected = pass_list(version)
    if not args.record and not expected.exists():
        parser.error(f"no pass list for Celery {version} ({expected.relative_to(ROOT)}): "
                     "run `make test-celery-baseline` once on a quiet machine and commit the list")

    sdist = fetch_sdist(version)
    python = ensure_venv(version, sdist)
    # Celery's pytest settings (test_* classes, markers, strict xfail), never this checkout's.
    command = [str(python), "-m", "pytest", "-c", "pyproject.toml", "--rootdir", ".",
               "-p", "no:celery", "-p", "celery.contrib.pytest", "-p", "celery_suite.plugin", "-ra",
               # A test that hangs ends as Celery's @flaky ones do; a test's own mark wins.
               "--timeout=300", *SUITE]
    command.append(f"--celery-suite-{'record' if args.record else 'expect'}={expected}")
    command.append(f"--celery-suite-racy={RACY}")
    if mode == "lease" and not args.with_differences:
        command.append(f"--celery-suite-differences={DIFFERENCES}")
    if args.subset == "ci":
        command += ["-k", CI_SUBSET]
    command += pytest_args
    env = {**DEFAULTS, **os.environ, "PYTHONPATH": str(HERE.parent), "CELERY_SUITE_TASK_CLS": mode}
    print(f"celery suite: Celery {version}, task_cls {mode}, broker {env['TEST_BROKER']}, "
          f"backend {env['TEST_BACKEND']}", flush=True)
    return subprocess.run(command, cwd=sdist, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
