"""Worker processes: each holds one system, and the systems take their trials in turn.

Each system runs in a fresh, spawned Python process of its own, so that its peak memory is its
own. The systems load and warm up one after the other, then take their trials in turn (one
trial of each per round, a different one first each round), so that the machine's drift over
minutes falls on all of them alike; all of them hold their model meanwhile.

Spawn pickles a process's target and arguments by module path: `serve` and every loader it is
handed must be module-level functions of an importable module, never lambdas or nested functions.
"""

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from benchmark.machine import CpuClock
from benchmark.memory import memory_high_water, memory_in_use
from benchmark.workload import ServingTrial, ServingWorkload, Trial, Workload, progress
from errors import UserError


@dataclass(frozen=True)
class Loaded:
    """A system ready to be timed, inside its worker process: model loaded, warm-up run done."""

    measure: Callable[[], Trial | ServingTrial]  # one timed run
    extras: Callable[[], Any]  # what the parent needs besides the trials, asked for after the last one


System = tuple[Callable[..., Loaded], tuple[Any, ...]]  # a loader, and its arguments after the workload


@dataclass(frozen=True)
class Finished:
    """What a worker reports after its last trial: its memory figures and its system's extras."""

    peak_mem_bytes: int
    base_mem_bytes: int
    final_mem_bytes: int | None
    extras: Any  # Loaded.extras's answer


@dataclass(frozen=True)
class SystemRun:
    """One system's raw measurements: its trials, and its worker process's memory figures."""

    trials: list[Trial | ServingTrial]
    others_busy_cores: float | None  # the most CPU other processes took during one of the timed trials
    peak_mem_bytes: int
    base_mem_bytes: int  # the high-water mark before loading the model: interpreter and libraries
    final_mem_bytes: int | None  # held after the trials: the model and whatever the runs keep


def serve(connection: Connection, load: Callable[..., Loaded], w: Workload | ServingWorkload, *args: Any) -> None:
    """A worker process's whole life: load and warm up, then one trial per request from the
    parent, then the memory figures and the system's extras. Every answer is ("ok", value) or
    the failure, which the parent raises."""
    try:
        base = memory_high_water(w.device)
        system = load(w, *args)
        connection.send(("ok", None))
        while connection.recv() == "trial":
            before = CpuClock.read()
            trial = system.measure()
            connection.send(("ok", (trial, CpuClock.others_between(before, CpuClock.read()))))
        extras = system.extras()
        connection.send(("ok", Finished(memory_high_water(w.device), base, memory_in_use(w.device), extras)))
    except (KeyboardInterrupt, EOFError, BrokenPipeError):  # Ctrl-C (the parent reports it), or the parent is gone
        return
    except UserError as e:
        connection.send(("user error", str(e)))
    except Exception:
        connection.send(("error", traceback.format_exc()))


class Worker:
    """One system in a spawned Python process of its own, so that its memory high-water mark is its
    own; it runs one trial whenever asked, and waits on its pipe in between."""

    def __init__(self, name: str, load: Callable[..., Loaded], w: Workload | ServingWorkload, *args: Any):
        self.name = name
        context = get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, load, w, *args))
        self.process.start()
        child.close()
        try:
            self.receive()  # loaded and warmed up
        except BaseException:
            self.close()
            raise

    def ask(self, request: str) -> Any:
        try:
            self.connection.send(request)
        except OSError:
            self.raise_died()
        return self.receive()

    def receive(self) -> Any:
        try:
            kind, value = self.connection.recv()
        except (EOFError, OSError):
            self.raise_died()
        if kind == "user error":
            raise UserError(value)
        if kind == "error":
            raise RuntimeError(f"the {self.name} benchmark process failed:\n{value}")
        return value

    def raise_died(self) -> NoReturn:
        raise UserError(f"the {self.name} benchmark process died before it finished (out of memory?)") from None

    def trial(self) -> tuple[Trial | ServingTrial, float | None]:
        return self.ask("trial")

    def finish(self) -> Finished:
        return self.ask("finish")

    def close(self) -> None:
        """Let the process end by itself (its pipe closes, so it stops waiting), else end it."""
        self.connection.close()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def timed_in_turn(w: Workload | ServingWorkload, systems: dict[str, System]) -> dict[str, tuple[SystemRun, Any]]:
    """Every system's trials, taken in turn: round i runs one trial of each, starting with the
    i-th system. The machine's speed drifts over minutes; taken in turn, that drift falls on
    every system alike instead of on whichever ran last. The systems load and warm up one after
    the other, never at the same time. Returns each system's run and extras."""
    workers: dict[str, Worker] = {}
    try:
        for name, (load, args) in systems.items():
            workers[name] = Worker(name, load, w, *args)
        names = list(workers)
        done: dict[str, list[tuple[Trial | ServingTrial, float | None]]] = {name: [] for name in names}
        for i in range(w.trials):
            for name in names[i % len(names):] + names[: i % len(names)]:
                trial, others_busy = workers[name].trial()
                done[name].append((trial, others_busy))
                progress(f"{name}: trial {i + 1}/{w.trials}: {trial.summary}")
        runs = {}
        for name, worker in workers.items():
            finished = worker.finish()
            busy = [others for _, others in done[name]]
            most_busy = None if None in busy else max(busy)
            run = SystemRun([t for t, _ in done[name]], most_busy, finished.peak_mem_bytes, finished.base_mem_bytes, finished.final_mem_bytes)
            runs[name] = (run, finished.extras)
        return runs
    finally:
        for worker in workers.values():
            worker.close()
