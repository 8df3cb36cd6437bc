"""What the machine allows, measured in the same run as the systems: the two ceilings and the
CPU that other processes take.

- The bandwidth roofline = read bandwidth / bytes per decode token. The read bandwidth is
  measured by summing a 1 GiB tensor with torch's threads: no decode that streams its weights
  from memory can beat it.
- The bare-matmul ceiling (bench.py --ceiling): the decode step's matrix products alone (per
  layer fused qkv, o, fused gate/up, down; then the LM head), with the loaded weights and batch
  rows, no attention and nothing else: the speed if everything but those kernels were free.
  The engine's worker times it right after each of its trials; the report gives the median.
- Others' CPU: on a machine with few cores another process taking a core slows every op, so
  the run reports how much CPU others took before it and during each timed trial.
"""

import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmark.memory import DecodeTraffic
from benchmark.workload import progress
from models.transformer import Transformer

BANDWIDTH_BYTES = 1 << 30
BUSY_WARNING_CORES = 0.2  # CPU taken by other processes beyond which the figures are flagged


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    accelerator: str | None  # the GPU, when the run is on CUDA
    torch: str
    threads: int  # torch's intra-op threads; the worker processes inherit the same setting
    others_busy_cores: float | None  # CPU other processes took in the second before the run
    read_gb_per_s: float


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_roofline(machine: Machine, traffic: DecodeTraffic) -> float:
    return machine.read_gb_per_s * 1e9 / traffic.bytes_per_token


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


def matmul_ceiling_tok_s(model: Transformer, batch: int, steps: int = 20, warmup: int = 3) -> float:
    """Tokens/s if a decode step were its matrix products only (the median of `steps` timed steps)."""
    linears = [m for layer in model.layers for m in (layer.attn.wqkv, layer.attn.wo, layer.mlp.w_gate_up, layer.mlp.w_down)]
    linears.append(model.lm_head)
    dtype, device = model.norm.weight.dtype, model.norm.weight.device
    inputs = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype, device=device) for m in linears}
    products = [(m, inputs[m.in_features]) for m in linears]  # each layer's own kernel: 16-bit, int8 or int4
    times = []
    with torch.inference_mode():
        for step in range(warmup + steps):
            synchronize(device)
            start = time.perf_counter()
            for linear, x in products:
                linear(x)
            synchronize(device)
            if step >= warmup:
                times.append(time.perf_counter() - start)
    return batch / statistics.median(times)


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
        cores = os.cpu_count() or 1
        # The two clocks tick at different rates (1/100 s against the process's own): on a loaded
        # machine the difference can come out a little above the cores there are.
        return min(max(others, 0.0) / max(after.elapsed_s - before.elapsed_s, 1e-9), cores)


def describe_machine(device: torch.device) -> Machine:
    before = CpuClock.read()
    time.sleep(1.0)
    busy = CpuClock.others_between(before, CpuClock.read())
    if busy is not None and busy > BUSY_WARNING_CORES:
        progress(f"warning: other processes use {busy:.1f} cores; they compete with this benchmark, whose figures will be low and noisy")
    progress("measuring the read bandwidth")
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return Machine(cpu_model(), os.cpu_count() or 1, accelerator, torch.__version__, torch.get_num_threads(), busy, read_bandwidth_gb_s(device))
