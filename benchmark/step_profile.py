"""Where a decode step's time goes (bench.py --profile): torch.profiler over the steps of one run,
after warm-up steps, each op's own time (its self time) put in one of a few kinds by its name.

The compiled groups run inductor's kernels from C++ host code (engine/cpu.py), or a saved
package's (engine/saved_step.py): the profiler sees each group's call as one event, whose own
time is its fused kernels (norms, RoPE, attention, SiLU, and any product inductor generates
itself), while the products it hands to torch's kernels show as those ops. The host's own time (Python, the token loop, what no op accounts for) is the
profiler's step event's. The profiler adds to every op, so the kinds sum to more than the step
timed without it: the shares are of that sum.
"""

import argparse
from collections.abc import Callable
import statistics
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from benchmark.report import table
from benchmark.workload import progress
from cli import checkpoint_and_quant, pick_device, pick_dtype
from engine.options import RunOptions, generate
from errors import UserError
from models.transformer import Transformer
from weights.forms import load_model

WARM_STEPS, PROFILED_STEPS = 20, 30
# (kind, substrings of the op names that belong to it), the first match wins.
KINDS = (
    ("4-bit products", ("_weight_int4pack_mm",)),
    ("8-bit products", ("_weight_int8pack_mm",)),
    ("16/32-bit products", ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn")),
    ("compiled kernels", ("CompiledFxGraph", "cpp_fused", "inductor", "saved step")),
    ("compile's calls (dynamo)", ("Dynamo", "Torch-Compiled Region", "CompiledFunction", "Pregraph bytecode", "AOTDispatcher")),
    ("attention (eager)", ("scaled_dot_product",)),
    ("host (Python, the token loop)", ("ProfilerStep",)),
)
OTHER = "other ops (sampling, RoPE rows, views, compiled calls' arguments)"


@dataclass
class StepProfile:
    step_ms: float  # the median step, timed without the profiler
    kinds_ms: dict[str, float]  # per profiled step, each kind's time

    def rows(self) -> list[list[str]]:
        total = sum(self.kinds_ms.values())
        return [[kind, f"{ms:.2f}", f"{100 * ms / total:.0f}%"] for kind, ms in self.kinds_ms.items()] + [["all (profiled)", f"{total:.2f}", "100%"]]


def kind_of(name: str) -> str:
    return next((kind for kind, marks in KINDS if any(mark in name for mark in marks)), OTHER)


def profile_steps(model: Transformer, prompt: list[int], warm_steps: int, steps: int, compile_step: bool) -> StepProfile:
    """Two runs of warm_steps + steps decode steps: one timed, one profiled over its last `steps`."""
    options = RunOptions(compile=compile_step)
    stamps: list[float] = []
    with torch.inference_mode():
        generate(model, [prompt], warm_steps + steps + 2, eos_ids=frozenset(), on_tokens=lambda _: stamps.append(time.perf_counter()), options=options)
        step_ms = 1e3 * statistics.median(b - a for a, b in zip(stamps[warm_steps:], stamps[warm_steps + 1 :]))
        window = torch.profiler.schedule(wait=warm_steps, warmup=1, active=steps, repeat=1)
        with profile(activities=[ProfilerActivity.CPU], schedule=window) as recording:
            generate(model, [prompt], warm_steps + steps + 2, eos_ids=frozenset(), on_tokens=lambda _: recording.step(), options=options)
    kinds = {kind: 0.0 for kind, _ in KINDS} | {OTHER: 0.0}
    for average in recording.key_averages():
        kinds[kind_of(average.key)] += average.self_cpu_time_total / 1e3 / steps
    return StepProfile(step_ms, kinds)


def print_profile(name: str, result: StepProfile) -> None:
    progress(f"{name}: profile done")
    print(f"\n{name}: one decode step, {result.step_ms:.2f} ms at the median (timed without the profiler)\n")
    print(table(["where", "ms per step", "share"], result.rows()))


def run_profile(args: argparse.Namespace, prompt_of: Callable[[int], list[int]]) -> None:
    """bench.py --profile: the step of the checkpoint bench.py would run, compiled and eager
    (or as --compile / --no-compile says), batch 1, after a prompt of --prompt-len tokens."""
    if args.batch != 1 or args.sweep is not None or args.compare not in (None, "none"):
        raise UserError("--profile looks at one decode step of one row; drop --batch, --sweep and --compare")
    device = pick_device(args.device)
    checkpoint, quant = checkpoint_and_quant(args.checkpoint, args.quant, args.group_size)
    model = load_model(checkpoint, pick_dtype(args.dtype, checkpoint, device, quant), device, quant, args.group_size)
    prompt = prompt_of(model.config.vocab_size)
    for compile_step in [True, False] if args.compile is None else [args.compile]:
        name = f"{checkpoint.name}, {'compiled' if compile_step else 'eager'}, {str(model.dtype).removeprefix('torch.')}"
        progress(f"{name}: {WARM_STEPS} steps, then {PROFILED_STEPS} timed and {PROFILED_STEPS} profiled")
        print_profile(name, profile_steps(model, prompt, WARM_STEPS, PROFILED_STEPS, compile_step))
