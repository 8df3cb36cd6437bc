"""Run model-written programs in child processes, with limits, and say whether they passed.

A program runs in a fresh Python interpreter, never in this process: in an empty temporary
folder, with an environment built from scratch (PATH only, and seeds and thread counts for
repeatable runs), stdin closed, and a wall-clock timeout that kills its whole process group.
Before the program starts, a preamble in the child caps its memory, CPU time, file size and
process count, and disables sockets.

This guards against accidents (an endless loop, a runaway allocation, a stray download, a
script that writes files), not against code written to escape: the child runs as our user.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MEMORY_BYTES = 2 << 30  # address space: room for any HumanEval solution, not for a runaway list
FILE_BYTES = 16 << 20  # largest file the program may write, its stderr included
STDERR_TAIL = 500  # characters of stderr kept in an Outcome

# Runs in the child before the program; argv[1] is the CPU-time cap in seconds.
# - The limits are set here rather than in a preexec_fn, which may deadlock a child forked from
#   a process with threads (run_programs uses a thread pool). They cover the program, not the
#   interpreter's start-up, which needs none. Hard limits equal soft ones, so the program cannot
#   raise them, but for CPU time: at the soft limit the kernel sends SIGXCPU (reported as a
#   timeout), at the hard one SIGKILL; equal, the two raced and a timeout read as a kill.
# - RLIMIT_NPROC 0: the program may start no process or thread. Linux does not apply it to root.
# - socket.socket stays a class, so that modules which subclass it (ssl) still import.
#   create_connection is replaced too, so that it fails before its DNS lookup.
# - random is seeded because some tests (HumanEval/38, /50, /53) draw unseeded inputs.
# - __name__ is not "__main__", as in the reference harness: a model's demo block does not run.
# - SystemExit becomes an error: an early exit() would end the run with status 0 before check() ran.
PREAMBLE = f"""\
import random, resource, runpy, socket, sys

cpu_s = int(sys.argv[1])
for limit, soft, hard in [
    (resource.RLIMIT_AS, {MEMORY_BYTES}, {MEMORY_BYTES}),
    (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
    (resource.RLIMIT_FSIZE, {FILE_BYTES}, {FILE_BYTES}),
    (resource.RLIMIT_CORE, 0, 0),
    (resource.RLIMIT_NPROC, 0, 0),
]:
    resource.setrlimit(limit, (soft, hard))


class NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        raise OSError("network disabled in the HumanEval sandbox")


def no_connection(*args, **kwargs):
    raise OSError("network disabled in the HumanEval sandbox")


socket.socket = NoSocket
socket.create_connection = no_connection
random.seed(0)
try:
    runpy.run_path("program.py", run_name="humaneval_program")
except SystemExit as e:
    raise RuntimeError(f"the program exited (status {{e.code!r}}) before its checks finished") from None
"""


@dataclass(frozen=True)
class Outcome:
    passed: bool
    reason: str  # "passed", "timed out", "failed: <last line of stderr>" or "error: killed by <signal>"
    stderr: str = ""  # the end of the program's stderr (its traceback, when it raised)


def run_program(source: str, timeout_s: float = 10.0) -> Outcome:
    """Run source as a script in a child interpreter; it passes when it exits with status 0."""
    with tempfile.TemporaryDirectory(prefix="humaneval-", ignore_cleanup_errors=True) as folder:
        (Path(folder) / "program.py").write_text(source, encoding="utf-8")
        stderr_path = Path(folder) / "stderr"
        with open(stderr_path, "wb") as stderr:
            child = subprocess.Popen(
                # -s, not -I: -I implies -E, which would ignore PYTHONHASHSEED. The environment is
                # built from scratch instead, so no other PYTHON* variable reaches the child.
                [sys.executable, "-s", "-c", PREAMBLE, str(math.ceil(timeout_s))],
                cwd=folder,
                env=child_environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # its own process group, killed as a whole below
            )
            try:
                status = child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                status = None
            finally:
                kill_group(child)
        tail = read_tail(stderr_path)
    return outcome(status, tail)


def run_programs(sources: list[str], timeout_s: float = 10.0, workers: int = 2) -> list[Outcome]:
    """Outcomes of several programs, in the order given; `workers` run at a time and a program
    that appears more than once runs once."""
    unique = list(dict.fromkeys(sources))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = dict(zip(unique, pool.map(lambda source: run_program(source, timeout_s), unique)))
    return [outcomes[source] for source in sources]


def child_environment() -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "PYTHONHASHSEED": "0",  # set and dict orders of strings repeat from run to run
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def kill_group(child: subprocess.Popen) -> None:
    """Kill the child and anything it started, whether or not it has exited."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def read_tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4 * STDERR_TAIL))  # up to 4 bytes a character
        return f.read().decode("utf-8", errors="replace")[-STDERR_TAIL:]


def outcome(status: int | None, stderr: str) -> Outcome:
    """status is the exit status, negative for a signal, None when the wall clock ran out."""
    if status == 0:
        return Outcome(passed=True, reason="passed", stderr=stderr)
    if status is None or status == -signal.SIGXCPU:
        return Outcome(passed=False, reason="timed out", stderr=stderr)
    if status < 0:
        return Outcome(passed=False, reason=f"error: killed by {signal.Signals(-status).name}", stderr=stderr)
    lines = stderr.strip().splitlines()
    return Outcome(passed=False, reason=f"failed: {lines[-1] if lines else f'exit status {status}'}", stderr=stderr)
