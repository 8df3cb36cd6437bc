"""Decode speed of the engine, side by side with transformers: same checkpoint, dtype, batch and prompt.

    python bench.py [--checkpoint DIR] [--dtype bfloat16] [--prompt-len 128] [--new-tokens 128]
                    [--ceiling] [--json OUT.json]
    python bench.py --sweep 128,512,1024,2048 [--plot bench_sweep.png]

The prompt is --batch rows of --prompt-len random token ids (seeded, the same for every system).
No EOS stops a run: every run makes exactly --new-tokens tokens per row. Each figure is the median
over --trials runs that follow one warm-up run. The table goes to stdout, progress to stderr.

Systems, each in a fresh process of its own, so that its peak memory is its own. They load and warm
up one after the other, then take their trials in turn (one trial of each per round, a different
one first each round), so that the machine's drift over minutes falls on all of them alike; all
of them hold their model meanwhile:
- engine: engine.generation.generate. TTFT is the time from the call to the first token on the host
  (cache allocation, prefill, and on CUDA the graph capture); decode tok/s = batch * decode steps /
  its decode time, which excludes all of that.
- transformers: AutoModelForCausalLM.generate, greedy, with its default dynamic cache;
- transformers_static: the same with cache_implementation="static".
  generate reports no split of its time, so TTFT is the time of a generate with max_new_tokens=1,
  and decode tok/s = (N - 1) * batch / (t_N - t_1), where t_N is a generate with max_new_tokens=N.

Bytes per decode token (engine.memory.decode_traffic): every weight once per step (the LM head in
full even when tied to the embedding, of which only B rows are read), plus each row's K/V for the
slots in use averaged over the decode, divided by the batch. Achieved GB/s = that * decode tok/s.

Two ceilings:
- the bandwidth roofline (machine.ceiling_tok_s) = read bandwidth / bytes per token, the read
  bandwidth measured in this run by summing a 1 GiB tensor with torch's threads: no decode that
  streams its weights from memory can beat it;
- the bare-matmul ceiling (--ceiling; machine.matmul_ceiling_tok_s): the decode step's matrix
  products alone (per layer fused qkv, o, fused gate/up, down; then the LM head), with the loaded
  weights, batch rows, no attention and nothing else: the speed if everything but those kernels were free.
  It is timed right after each of the engine's trials, and its median reported.

Peak memory: on CPU the process's resident high-water mark, which includes Python, torch and, for
the transformers systems, the transformers library (`before loading` shows that part); on CUDA,
torch's peak allocation on the device. Loading a checkpoint stored in another dtype can set the
peak (file pages and converted copies at once); `held after the trials` is the steady state.
"""

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn.functional as F

from cli import DTYPES, add_compression_args, compression_config, pick_device, pick_dtype
from compression.config import CompressionConfig
from compression.manager import CompressionStats
from engine.generation import generate
from engine.memory import DecodeTraffic, decode_traffic, memory_high_water, memory_in_use
from errors import UserError, run_command
from models.transformer import Transformer
from weights.download import resolve_checkpoint
from weights.loader import load_model, read_config, stored_dtype

PROMPT_SEED = 0
BANDWIDTH_BYTES = 1 << 30
MIB = 2**20
BUSY_WARNING_CORES = 0.2  # CPU taken by other processes beyond which the figures are flagged
RATIO_KEYS = ("decode_tok_s", "ttft_s", "prefill_tok_s", "peak_mem_mib")


@dataclass(frozen=True)
class Workload:
    """What every system is asked to do; each worker process receives it whole."""

    checkpoint: Path
    dtype: torch.dtype
    device: torch.device
    prompts: list[list[int]]  # batch rows of equal length
    new_tokens: int
    trials: int
    compile: bool  # the engine's decode step only
    ceiling: bool
    compression: CompressionConfig  # the engine's KV policy; transformers always keeps the full cache

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def prompt_len(self) -> int:
        return len(self.prompts[0])


@dataclass(frozen=True)
class Trial:
    ttft_s: float
    decode_tok_s: float
    kv_cache_bytes: int


@dataclass(frozen=True)
class SystemRun:
    """One system's raw measurements: its trials, and its worker process's memory figures."""

    trials: list[Trial]
    others_busy_cores: float | None  # the most CPU other processes took during one of the timed trials
    peak_mem_bytes: int
    base_mem_bytes: int  # the high-water mark before loading the model: interpreter and libraries
    final_mem_bytes: int | None  # held after the trials: the model and whatever the runs keep


@dataclass(frozen=True)
class CompressionCost:
    """What the engine's KV policy cost in the last trial: medians per event, in milliseconds."""

    compactions: int
    compaction_ms: float | None
    refreshes: int
    refresh_ms: float | None  # BeaconKV's FPS refreshes of the beacon queries

    @classmethod
    def of(cls, stats: CompressionStats) -> "CompressionCost":
        def median_ms(seconds: list[float]) -> float | None:
            return statistics.median(seconds) * 1000 if seconds else None

        return cls(stats.compactions, median_ms(stats.compaction_s), len(stats.refresh_s), median_ms(stats.refresh_s))


@dataclass(frozen=True)
class EngineExtras:
    """What the engine's worker reports besides its trials."""

    traffic: DecodeTraffic
    matmul_ceiling_tok_s: float | None
    compression: CompressionCost | None  # None without a KV policy


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    accelerator: str | None  # the GPU, when the run is on CUDA
    torch: str
    threads: int  # torch's intra-op threads; the worker processes inherit the same setting
    others_busy_cores: float | None  # CPU other processes took in the second before the run
    read_gb_per_s: float


@dataclass(frozen=True)
class Figures:
    """One system's reported figures: medians over the trials, and the trials themselves."""

    decode_tok_s: float
    ms_per_token: float  # one decode step: how long each row waits for its next token
    ttft_s: float
    prefill_tok_s: float  # batch * prompt_len / ttft_s
    gb_per_s: float  # bytes per token * decode_tok_s
    roofline_share: float  # decode_tok_s / machine.ceiling_tok_s
    matmul_ceiling_share: float | None  # decode_tok_s / machine.matmul_ceiling_tok_s
    peak_mem_mib: float
    base_mem_mib: float
    final_mem_mib: float | None
    kv_cache_mib: float
    others_busy_cores: float | None  # the most CPU other processes took during one timed trial: ~0 for a clean figure
    decode_tok_s_trials: list[float]
    ttft_s_trials: list[float]


@dataclass(frozen=True)
class Report:
    workload: Workload
    model_type: str
    machine: Machine
    traffic: DecodeTraffic
    matmul_ceiling_tok_s: float | None
    systems: dict[str, Figures]  # "engine" first
    compression: CompressionCost | None

    @property
    def ceiling_tok_s(self) -> float:
        return bandwidth_roofline(self.machine, self.traffic)

    def ratios(self) -> dict[str, dict[str, float]]:
        engine = self.systems["engine"]
        return {
            f"engine/{name}": {key: getattr(engine, key) / getattr(other, key) for key in RATIO_KEYS}
            for name, other in self.systems.items()
            if name != "engine"
        }

    def to_json(self) -> dict[str, Any]:
        w = self.workload
        return {
            "machine": {**asdict(self.machine), "ceiling_tok_s": self.ceiling_tok_s, "matmul_ceiling_tok_s": self.matmul_ceiling_tok_s},
            "config": {
                "checkpoint": str(w.checkpoint),
                "model_type": self.model_type,
                "dtype": dtype_name(w.dtype),
                "device": str(w.device),
                "batch": w.batch,
                "prompt_len": w.prompt_len,
                "new_tokens": w.new_tokens,
                "trials": w.trials,
                "compile": w.compile,
                "kv_policy": asdict(w.compression),
            },
            "traffic": {
                "bytes_per_token": self.traffic.bytes_per_token,
                "bytes_per_step": self.traffic.bytes_per_step,
                "weight_bytes_per_step": self.traffic.weight_bytes,
                "kv_bytes_per_slot": self.traffic.kv_bytes_per_slot,
                "mean_kv_slots": self.traffic.mean_slots,
            },
            **{name: asdict(figures) for name, figures in self.systems.items()},
            "ratios": self.ratios(),
            "compression": None if self.compression is None else asdict(self.compression),
        }


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_roofline(machine: Machine, traffic: DecodeTraffic) -> float:
    return machine.read_gb_per_s * 1e9 / traffic.bytes_per_token


# ---- measurements that run in the parent process ----


def read_bandwidth_gb_s(device: torch.device, passes: int = 7) -> float:
    """GB/s of summing a 1 GiB tensor (the median pass), with torch's threads as the engine uses them."""
    data = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32, device=device)  # written: every page is really there
    data.sum()
    times = []
    for _ in range(passes):
        synchronize(device)
        start = time.perf_counter()
        data.sum()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return data.nbytes / statistics.median(times) / 1e9


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class CpuClock:
    """CPU time of the whole machine and of this process: the difference of two readings tells how
    much CPU other processes took in between. On a machine with few cores that matters a lot: torch's
    threads meet at the end of every op, so one thread waiting for a busy core delays them all."""

    busy_s: float  # all cores together (hypervisor steal included), since boot
    elapsed_s: float  # since boot
    own_s: float  # this process, all its threads

    @classmethod
    def read(cls) -> "CpuClock | None":
        stat = Path("/proc/stat")
        if not stat.is_file():  # not Linux: the figure is left out
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, stat.read_text().split()[1:9])
        total = user + nice + system + idle + iowait + irq + softirq + steal
        tick = os.sysconf("SC_CLK_TCK")
        own = os.times()
        return cls((total - idle - iowait) / tick, total / tick / (os.cpu_count() or 1), own.user + own.system)

    @staticmethod
    def others_between(before: "CpuClock | None", after: "CpuClock | None") -> float | None:
        """Cores' worth of CPU taken by other processes between two readings."""
        if before is None or after is None:
            return None
        others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
        return max(others, 0.0) / max(after.elapsed_s - before.elapsed_s, 1e-9)


def describe_machine(device: torch.device) -> Machine:
    before = CpuClock.read()
    time.sleep(1.0)
    busy = CpuClock.others_between(before, CpuClock.read())
    if busy is not None and busy > BUSY_WARNING_CORES:
        progress(f"warning: other processes use {busy:.1f} cores; they compete with this benchmark, whose figures will be low and noisy")
    progress("measuring the read bandwidth")
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return Machine(cpu_model(), os.cpu_count() or 1, accelerator, torch.__version__, torch.get_num_threads(), busy, read_bandwidth_gb_s(device))


# ---- the systems: each in a process of its own, their trials taken in turn ----


@dataclass(frozen=True)
class Loaded:
    """A system ready to be timed, inside its worker process: model loaded, warm-up run done."""

    measure: Callable[[], Trial]  # one timed run
    extras: Callable[[], Any]  # what the parent needs besides the trials, asked for after the last one


System = tuple[Callable[..., Loaded], tuple[Any, ...]]  # a loader, and its arguments after the workload


@dataclass(frozen=True)
class Finished:
    """What a worker reports after its last trial: its memory figures and its system's extras."""

    peak_mem_bytes: int
    base_mem_bytes: int
    final_mem_bytes: int | None
    extras: Any  # Loaded.extras's answer


def serve(connection: Connection, load: Callable[..., Loaded], w: Workload, *args: Any) -> None:
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

    def __init__(self, name: str, load: Callable[..., Loaded], w: Workload, *args: Any):
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

    def trial(self) -> tuple[Trial, float | None]:
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


def timed_in_turn(w: Workload, systems: dict[str, System]) -> dict[str, tuple[SystemRun, Any]]:
    """Every system's trials, taken in turn: round i runs one trial of each, starting with the
    i-th system. The machine's speed drifts by 10-20% over minutes here; taken in turn, that
    drift falls on every system alike instead of on whichever ran last. The systems load and
    warm up one after the other, never at the same time. Returns each system's run and extras."""
    workers: dict[str, Worker] = {}
    try:
        for name, (load, args) in systems.items():
            workers[name] = Worker(name, load, w, *args)
        names = list(workers)
        done: dict[str, list[tuple[Trial, float | None]]] = {name: [] for name in names}
        for i in range(w.trials):
            for name in names[i % len(names):] + names[: i % len(names)]:
                trial, others_busy = workers[name].trial()
                done[name].append((trial, others_busy))
                progress(f"{name}: trial {i + 1}/{w.trials}: TTFT {trial.ttft_s:.4f} s, decode {trial.decode_tok_s:.1f} tok/s")
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


def load_engine(w: Workload) -> Loaded:
    progress(f"engine: loading {w.checkpoint} as {dtype_name(w.dtype)} on {w.device}")
    model = load_model(w.checkpoint, w.dtype, w.device)
    stats: list[CompressionStats | None] = []
    ceilings: list[float] = []

    def measure() -> Trial:
        first_token_at: list[float] = []

        def on_tokens(_: list[int | None]) -> None:
            if not first_token_at:
                first_token_at.append(time.perf_counter())

        start = time.perf_counter()
        with torch.inference_mode():
            result = generate(
                model, w.prompts, w.new_tokens, eos_ids=frozenset(), compile=w.compile, on_tokens=on_tokens,
                compression=w.compression, cuda_graph=w.device.type == "cuda",
            )
        stats.append(result.compression)
        trial = Trial(first_token_at[0] - start, w.batch * result.decode_steps / result.decode_s, result.kv_cache_bytes)
        if w.ceiling:  # right after each trial, so that the share compares figures taken together
            ceilings.append(matmul_ceiling_tok_s(model, w.batch))
        return trial

    def extras() -> EngineExtras:
        ceiling = statistics.median(ceilings[1:]) if w.ceiling else None  # the warm-up's is left out, as its trial is
        compression = None if stats[-1] is None else CompressionCost.of(stats[-1])
        return EngineExtras(decode_traffic(model, w.batch, w.prompt_len, w.new_tokens), ceiling, compression)

    progress("engine: warm-up run" + (", which compiles the decode step" if w.compile else ""))
    measure()
    return Loaded(measure, extras)


def matmul_ceiling_tok_s(model: Transformer, batch: int, steps: int = 20, warmup: int = 3) -> float:
    """Tokens/s if a decode step were its matrix products only (the median of `steps` timed steps)."""
    linears = [m for layer in model.layers for m in (layer.attn.wqkv, layer.attn.wo, layer.mlp.w_gate_up, layer.mlp.w_down)]
    linears.append(model.lm_head)
    weight = model.lm_head.weight
    inputs = {m.in_features: torch.randn(batch, m.in_features, dtype=weight.dtype, device=weight.device) for m in linears}
    products = [(inputs[m.in_features], m.weight, m.bias) for m in linears]
    times = []
    with torch.inference_mode():
        for step in range(warmup + steps):
            synchronize(weight.device)
            start = time.perf_counter()
            for x, w, b in products:
                F.linear(x, w, b)
            synchronize(weight.device)
            if step >= warmup:
                times.append(time.perf_counter() - start)
    return batch / statistics.median(times)


def load_transformers(w: Workload, static: bool) -> Loaded:
    import transformers  # only the transformers processes pay for importing it

    transformers.logging.set_verbosity_error()  # generation-config advice, not results
    name = "transformers_static" if static else "transformers"
    progress(f"{name}: loading {w.checkpoint} as {dtype_name(w.dtype)} on {w.device}")
    model = transformers.AutoModelForCausalLM.from_pretrained(w.checkpoint, dtype=w.dtype).to(w.device).eval()
    ids = torch.tensor(w.prompts, device=w.device)
    options: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), do_sample=False, return_dict_in_generate=True)
    if static:
        options["cache_implementation"] = "static"

    def timed_generate(n: int) -> tuple[float, Any]:
        synchronize(w.device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **options)
        synchronize(w.device)
        return time.perf_counter() - start, out

    def measure() -> Trial:
        t_1, _ = timed_generate(1)
        t_n, out = timed_generate(w.new_tokens)
        kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.cache.layers)
        return Trial(t_1, (w.new_tokens - 1) * w.batch / (t_n - t_1), kv_bytes)

    progress(f"{name}: warm-up run")
    measure()
    return Loaded(measure, lambda: None)


# ---- one benchmark point: every system on one workload ----


def figures(run: SystemRun, w: Workload, traffic: DecodeTraffic, roofline_tok_s: float, matmul_tok_s: float | None) -> Figures:
    decode = statistics.median(t.decode_tok_s for t in run.trials)
    ttft = statistics.median(t.ttft_s for t in run.trials)
    return Figures(
        decode_tok_s=decode,
        ms_per_token=1000 * w.batch / decode,
        ttft_s=ttft,
        prefill_tok_s=w.batch * w.prompt_len / ttft,
        gb_per_s=traffic.bytes_per_token * decode / 1e9,
        roofline_share=decode / roofline_tok_s,
        matmul_ceiling_share=decode / matmul_tok_s if matmul_tok_s else None,
        peak_mem_mib=run.peak_mem_bytes / MIB,
        base_mem_mib=run.base_mem_bytes / MIB,
        final_mem_mib=None if run.final_mem_bytes is None else run.final_mem_bytes / MIB,
        kv_cache_mib=run.trials[-1].kv_cache_bytes / MIB,
        others_busy_cores=run.others_busy_cores,
        decode_tok_s_trials=[t.decode_tok_s for t in run.trials],
        ttft_s_trials=[t.ttft_s for t in run.trials],
    )


def measure(w: Workload, model_type: str, machine: Machine, compare: bool) -> Report:
    systems: dict[str, System] = {"engine": (load_engine, ())}
    if compare:
        systems["transformers"] = (load_transformers, (False,))
        systems["transformers_static"] = (load_transformers, (True,))
    runs = timed_in_turn(w, systems)
    _, engine = runs["engine"]
    roofline = bandwidth_roofline(machine, engine.traffic)
    figures_by_system = {name: figures(run, w, engine.traffic, roofline, engine.matmul_ceiling_tok_s) for name, (run, _) in runs.items()}
    return Report(w, model_type, machine, engine.traffic, engine.matmul_ceiling_tok_s, figures_by_system, engine.compression)


# ---- output ----


def number(x: float) -> str:
    """Three or four significant digits, never in exponent form."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}" if abs(x) >= 1 else f"{x:.3g}"


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


TABLE_ROWS: list[tuple[str, Callable[[Figures], str]]] = [
    ("decode (tok/s)", lambda f: number(f.decode_tok_s)),
    ("decode (ms/token)", lambda f: number(f.ms_per_token)),
    ("TTFT (s)", lambda f: number(f.ttft_s)),
    ("prefill (tok/s)", lambda f: number(f.prefill_tok_s)),
    ("achieved (GB/s)", lambda f: number(f.gb_per_s)),
    ("bandwidth roofline share (%)", lambda f: percent(f.roofline_share)),
    ("bare-matmul ceiling share (%)", lambda f: percent(f.matmul_ceiling_share)),
    ("peak memory (MiB)", lambda f: number(f.peak_mem_mib)),
    ("  of which before loading (MiB)", lambda f: number(f.base_mem_mib)),
    ("held after the trials (MiB)", lambda f: "-" if f.final_mem_mib is None else number(f.final_mem_mib)),
    ("KV cache (MiB)", lambda f: number(f.kv_cache_mib)),
    ("others' CPU, busiest trial (cores)", lambda f: "-" if f.others_busy_cores is None else f"{f.others_busy_cores:.2f}"),
]


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [[cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)] for row in [header, *rows]]
    return "\n".join("  ".join(line) for line in lines)


def describe(r: Report) -> str:
    m, w, t = r.machine, r.workload, r.traffic
    device = m.accelerator or f"{m.cpu}, {m.cores} cores"
    matmul = f" | bare-matmul ceiling {number(r.matmul_ceiling_tok_s)} tok/s" if r.matmul_ceiling_tok_s else ""
    busy = "" if m.others_busy_cores is None else f" | others' CPU at the start: {m.others_busy_cores:.2f} cores"
    return "\n".join([
        f"machine: {device} | torch {m.torch}, {m.threads} threads | read bandwidth {number(m.read_gb_per_s)} GB/s{busy}",
        f"model: {w.checkpoint.name} ({r.model_type}), {dtype_name(w.dtype)} on {w.device}"
        f"{', compiled decode step' if w.compile else ''} | batch {w.batch}, prompt {w.prompt_len}, "
        f"{w.new_tokens} new tokens | median of {w.trials} trials",
        f"bytes per decode token: {number(t.bytes_per_token / 1e6)} MB (weights {number(t.weight_bytes / 1e6)} MB per step, "
        f"KV {number(t.kv_bytes_per_slot * t.mean_slots / 1e6)} MB per row) | bandwidth roofline {number(r.ceiling_tok_s)} tok/s{matmul}",
    ])


def print_report(r: Report) -> None:
    names = list(r.systems)
    rows = [[label, *(cell(r.systems[name]) for name in names)] for label, cell in TABLE_ROWS]
    print(describe(r), table(["", *names], rows), sep="\n\n")
    for pair, ratio in r.ratios().items():
        print(
            f"{pair}: decode {ratio['decode_tok_s']:.2f}x (>1: engine faster), TTFT {ratio['ttft_s']:.2f}x (<1: engine faster), "
            f"peak memory {ratio['peak_mem_mib']:.2f}x"
        )
    c = r.compression
    if c is not None:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        print(f"engine's KV policy in the last trial: {c.compactions} compactions ({ms(c.compaction_ms)} each, median), "
              f"{c.refreshes} beacon refreshes ({ms(c.refresh_ms)} each)")
    busiest = max((f.others_busy_cores or 0.0 for f in r.systems.values()), default=0.0)
    if busiest > BUSY_WARNING_CORES:
        print(f"warning: other processes took up to {busiest:.2f} cores during the timed trials: these figures understate the systems")
    print(flush=True)


def print_sweep(reports: list[Report]) -> None:
    names = list(reports[0].systems)
    header = ["prompt", *(f"{name} (tok/s)" for name in names), "roofline (tok/s)"]
    rows = [[str(r.workload.prompt_len), *(number(r.systems[n].decode_tok_s) for n in names), number(r.ceiling_tok_s)] for r in reports]
    print("decode speed by prompt length", table(header, rows), sep="\n", end="\n\n")


def plot_sweep(reports: list[Report], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    lengths = [r.workload.prompt_len for r in reports]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in reports[0].systems:
        ax.plot(lengths, [r.systems[name].decode_tok_s for r in reports], marker="o", label=name)
    ax.plot(lengths, [r.ceiling_tok_s for r in reports], linestyle="--", color="gray", label="bandwidth roofline")
    if reports[0].matmul_ceiling_tok_s:
        ax.plot(lengths, [r.matmul_ceiling_tok_s for r in reports], linestyle=":", color="black", label="bare-matmul ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("decode (tok/s)")
    w, m = reports[0].workload, reports[0].machine
    ax.set_title(f"{w.checkpoint.name}, {dtype_name(w.dtype)}, batch {w.batch}, {w.new_tokens} new tokens\n{m.accelerator or m.cpu}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    progress(f"wrote {path}")


# ---- command line ----


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="model folder or hub repo id already downloaded; default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    p.add_argument("--prompt-len", type=int, help="random prompt tokens per row (default 128)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row, the first one by prefill")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: the checkpoint's dtype, bfloat16 instead of float16 on CPU")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--trials", type=int, default=5, help="timed runs per system, after one warm-up run; figures are their medians")
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction,
        help="torch.compile the engine's decode step; the warm-up run compiles it (default: on CPU, where it measured 1.49x "
        "eager's SmolLM2 bfloat16 decode speed, before the C++ host code took 16%% more off a step; off on CUDA, where the CUDA graph removes the per-op overhead)",
    )
    p.add_argument("--compare", choices=["transformers", "none"], help="also measure transformers (default: when it is installed)")
    p.add_argument("--ceiling", action="store_true", help="also time the bare matrix products of a decode step")
    p.add_argument("--json", type=Path, metavar="OUT", help="write every figure to this JSON file")
    p.add_argument("--sweep", metavar="LENGTHS", help="comma-separated prompt lengths, e.g. 128,512,1024,2048: one benchmark each, and a plot")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="where --sweep draws decode tok/s against prompt length (default bench_sweep.png)")
    p.add_argument("--seed", type=int, default=0, help="for the random KV policy")
    add_compression_args(p)
    return p.parse_args(argv)


def positive(name: str, value: int, minimum: int = 1) -> int:
    if value < minimum:
        raise UserError(f"{name} must be >= {minimum}, got {value}")
    return value


def prompt_lengths(args: argparse.Namespace) -> list[int]:
    if args.sweep is None:
        if args.plot is not None:
            raise UserError("--plot draws the result of --sweep; add --sweep LENGTHS or drop --plot")
        return [positive("--prompt-len", 128 if args.prompt_len is None else args.prompt_len)]
    if args.prompt_len is not None:
        raise UserError("--sweep sets the prompt lengths; drop --prompt-len")
    try:
        lengths = sorted({int(item) for item in args.sweep.split(",")})
    except ValueError:
        raise UserError(f"--sweep takes comma-separated prompt lengths like 128,512,1024, got {args.sweep!r}") from None
    for length in lengths:
        positive("every --sweep length", length)
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("--sweep draws its plot with matplotlib, which is not installed: pip install matplotlib")
    return lengths


def wants_transformers(choice: str | None) -> bool:
    installed = importlib.util.find_spec("transformers") is not None
    if choice == "transformers" and not installed:
        raise UserError("--compare transformers needs transformers, which is not installed: pip install transformers (or --compare none)")
    return installed if choice is None else choice == "transformers"


def random_prompts(vocab_size: int, batch: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(vocab_size, (batch, length), generator=generator).tolist()


def default_checkpoint() -> Path:
    from weights.packaged import smollm2_checkpoint  # imports the GGUF machinery only when it is needed

    return smollm2_checkpoint()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    batch = positive("--batch", args.batch)
    trials = positive("--trials", args.trials)
    new_tokens = positive("--new-tokens", args.new_tokens, minimum=2)  # the first new token comes from prefill
    lengths = prompt_lengths(args)
    compare = wants_transformers(args.compare)
    plot = args.plot or Path("bench_sweep.png")
    for out in (args.json, plot):
        if out is not None and not out.parent.is_dir():
            raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    device = pick_device(args.device)
    checkpoint = default_checkpoint() if args.checkpoint is None else resolve_checkpoint(args.checkpoint)
    config = read_config(checkpoint)
    dtype = pick_dtype(args.dtype, stored_dtype(checkpoint), device)
    if lengths[-1] + new_tokens > config.max_position_embeddings:
        raise UserError(
            f"prompt of {lengths[-1]} + {new_tokens} new tokens exceeds the model's {config.max_position_embeddings} positions; "
            "use a shorter prompt or fewer --new-tokens"
        )

    compile_step = device.type == "cpu" if args.compile is None else args.compile
    machine = describe_machine(device)
    reports = []
    for length in lengths:
        w = Workload(checkpoint, dtype, device, random_prompts(config.vocab_size, batch, length), new_tokens, trials, compile_step, args.ceiling, compression_config(args))
        reports.append(measure(w, config.model_type, machine, compare))
        print_report(reports[-1])
    if args.sweep is not None:
        print_sweep(reports)
        plot_sweep(reports, plot)
    if args.json is not None:
        data = reports[0].to_json() if args.sweep is None else {"sweep": [r.to_json() for r in reports], "plot": str(plot)}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        progress(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
