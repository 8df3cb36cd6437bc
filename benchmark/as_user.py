"""bench.py --as-user: the bundled model as a user runs it, each run a fresh process timed from its
start to its exit, beside llama.cpp on the same GGUF file.

- engine --compile, cold cache: `python generate.py PROMPT --compile` with an empty inductor cache
  of its own, so the run pays the whole compile (the first run on a new machine);
- engine --compile, warm cache: the same with a cache that one earlier run filled (every later run):
  it loads the saved step (engine/saved_step.py);
- engine --no-compile: eager. The default command is one of these two: it compiles from
  cli.SAVED_STEP_FROM_TOKENS tokens on;
- llama.cpp: a process that loads the GGUF file with llama-cpp-python, feeds it the same prompt
  tokens and decodes greedily, as many threads as torch uses.

Every run makes exactly --new-tokens tokens (the engine with --ignore-eos, llama.cpp never looks for
EOS), greedy. Decode tok/s is the one each process reports for itself; wall time covers everything
(interpreter start, imports, loading, compiling, prefill, decode); the first token is timed from the
launch to the answer's first byte on stdout. Each figure is the median of
--trials runs, the systems taking their runs in turn.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmark.machine import Machine
from cli import SAVED_STEP_FROM_TOKENS
from benchmark.workload import progress
from errors import UserError

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
REPO = Path(__file__).resolve().parent.parent
DECODE_RATE = re.compile(r"decode: ([0-9.]+) tok/s")


@dataclass(frozen=True)
class UserRun:
    wall_s: float
    first_token_s: float  # from the launch to the first byte of the answer on stdout
    decode_tok_s: float


def _timed(command: list[str], env: dict[str, str]) -> UserRun:
    with tempfile.TemporaryFile() as stderr_file:  # a file, not a pipe: however much it writes there, it never blocks
        start = time.perf_counter()
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr_file, cwd=REPO)
        process.stdout.read(1)  # the answer streams: its first byte is the first token's text
        first_token = time.perf_counter() - start
        process.communicate()
        wall = time.perf_counter() - start
        stderr_file.seek(0)
        stderr = stderr_file.read().decode(errors="replace")
    if process.returncode != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
        raise UserError(f"{' '.join(command[:3])} ... failed (exit {process.returncode}): {last}")
    rate = DECODE_RATE.findall(stderr)
    if not rate:
        raise UserError(f"no 'decode: N tok/s' in the output of {' '.join(command[:3])} ...: {stderr.strip()[-300:]}")
    return UserRun(wall, first_token, float(rate[-1]))


def engine_command(new_tokens: int, *flags: str) -> list[str]:
    return [sys.executable, "generate.py", PROMPT, "--max-new-tokens", str(new_tokens), "--ignore-eos", "--temperature", "0", *flags]


def llama_cpp_command(gguf: Path, prompt_tokens: list[int], new_tokens: int, threads: int) -> list[str]:
    return [sys.executable, "-m", "benchmark.llama_cpp_run", str(gguf), json.dumps(prompt_tokens), str(new_tokens), str(threads)]


def measure_as_user(gguf: Path | None, prompt_tokens: list[int], new_tokens: int, trials: int, threads: int) -> dict[str, list[UserRun]]:
    """Each system's runs, in turn; the warm cache is filled by one untimed run first."""
    runs: dict[str, list[UserRun]] = {"engine --compile, cold cache": [], "engine --compile, warm cache": [], "engine --no-compile": []}
    if gguf is not None:
        runs["llama.cpp"] = []
    with tempfile.TemporaryDirectory(prefix="bench-as-user-") as scratch:
        warm = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(scratch) / "warm"))
        progress("engine: one run to fill the warm cache")
        _timed(engine_command(new_tokens, "--compile"), warm)
        for trial in range(trials):
            cold = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(scratch) / f"cold-{trial}"))
            for name, command, env in (
                ("engine --compile, cold cache", engine_command(new_tokens, "--compile"), cold),
                ("engine --compile, warm cache", engine_command(new_tokens, "--compile"), warm),
                ("engine --no-compile", engine_command(new_tokens, "--no-compile"), warm),
                *([("llama.cpp", llama_cpp_command(gguf, prompt_tokens, new_tokens, threads), dict(os.environ))] if gguf else []),
            ):
                runs[name].append(_timed(command, env))
                progress(f"trial {trial + 1}/{trials}, {name}: {runs[name][-1].wall_s:.1f} s, decode {runs[name][-1].decode_tok_s:.1f} tok/s")
    return runs


def print_as_user(runs: dict[str, list[UserRun]], machine: Machine, new_tokens: int, trials: int) -> None:
    peer = runs.get("llama.cpp")
    peer_wall = statistics.median(r.wall_s for r in peer) if peer else None
    peer_rate = statistics.median(r.decode_tok_s for r in peer) if peer else None
    default = "--compile" if new_tokens >= SAVED_STEP_FROM_TOKENS else "--no-compile"
    print(f"as a user runs it: bundled SmolLM2-135M-Instruct, `python generate.py PROMPT` (greedy, {new_tokens} new tokens), a fresh process per run")
    print(f"the default command at {new_tokens} tokens is the {default} one (it compiles from {SAVED_STEP_FROM_TOKENS} tokens on)")
    print(f"machine: {machine.cpu}, {machine.cores} cores, torch {machine.torch}, {machine.threads} threads; medians of {trials} runs")
    print("| run | wall s | first token s | decode tok/s | wall vs llama.cpp | decode vs llama.cpp |")
    print("|---|---|---|---|---|---|")
    for name, items in runs.items():
        wall = statistics.median(r.wall_s for r in items)
        first = statistics.median(r.first_token_s for r in items)
        rate = statistics.median(r.decode_tok_s for r in items)
        vs_wall = f"{wall / peer_wall:.2f}x" if peer_wall else ""
        vs_rate = f"{rate / peer_rate:.2f}x" if peer_rate else ""
        print(f"| {name} | {wall:.1f} | {first:.2f} | {rate:.1f} | {vs_wall} | {vs_rate} |")
