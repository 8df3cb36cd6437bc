"""What every system is asked to do (a Workload) and what one timed run of it gives back (a Trial);
for bench.py --workload, a ServingWorkload and a ServingTrial.

The prompts are random token ids, the same for every system; no EOS stops a run, so every run
makes exactly the new tokens asked of each prompt.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from compression.config import CompressionConfig
from errors import UserError
from kv.paged import PageConfig
from engine.scheduler import Request
from models.parallel import TensorParallel


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
    quant: str = "none"  # the engine's weights: none, int8 or int4 (models/quantized.py)
    group_size: int = 32
    gguf: Path | None = None  # the file llama.cpp runs
    parallel: TensorParallel | None = None  # under torchrun: this rank's place; the engine then runs in the rank's own process
    peer_checkpoint: Path | None = None  # what transformers loads, when the engine's checkpoint is one only it reads
    kv_dtype: str = "auto"  # how the engine's cache stores keys and values (kv/quantized.py); the other systems keep theirs

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def quant_label(self) -> str:
        """The engine's weight format, e.g. "int4 in groups of 32"; empty for the checkpoint's own."""
        return "" if self.quant == "none" else self.quant + (f" in groups of {self.group_size}" if self.quant == "int4" else "")

    @property
    def prompt_len(self) -> int:
        return len(self.prompts[0])


@dataclass(frozen=True)
class Trial:
    ttft_s: float
    decode_tok_s: float
    kv_cache_bytes: int

    @property
    def summary(self) -> str:
        return f"TTFT {self.ttft_s:.4f} s, decode {self.decode_tok_s:.1f} tok/s"


def progress(message: str) -> None:
    """Progress goes to stderr, so that stdout carries the report alone."""
    print(message, file=sys.stderr, flush=True)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ServingWorkload:
    """bench.py --workload: many prompts of mixed lengths, each with its own number of new tokens,
    answered max_batch at a time."""

    checkpoint: Path
    dtype: torch.dtype
    device: torch.device
    requests: list[Request]
    max_batch: int
    trials: int
    compile: bool  # the engine's decode step
    compression: CompressionConfig  # the engine's KV policy, in both of its batchings
    pages: PageConfig  # continuous batching's cache; n_blocks None: static batching's memory
    quant: str = "none"
    group_size: int = 32
    peer_checkpoint: Path | None = None  # what transformers loads, when the engine's checkpoint is one only it reads
    kv_dtype: str = "auto"  # how the engine's cache stores keys and values (kv/quantized.py); the other systems keep theirs

    @property
    def new_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def row_slots(self) -> int:
        """The slots per row static batching allocates: the longest prompt and the most new tokens,
        one cache shape for every batch (one compiled step)."""
        return self.compression.slots_needed(max(len(r.prompt) for r in self.requests), max(r.max_new_tokens for r in self.requests))


@dataclass(frozen=True)
class ServingTrial:
    seconds: float  # from the first prefill to the last answer
    new_tokens: int  # the tokens asked for, each prompt's own: a batch's longer rows make no extra useful token
    kv_peak_bytes: int  # the most KV cache memory held at once
    most_rows: int  # the most prompts decoded at once
    ttft_s: list[float] | None = None  # per request, from sending it to its first token (the server's systems)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def summary(self) -> str:
        return f"{self.seconds:.1f} s, {self.tok_s:.1f} tok/s, KV peak {self.kv_peak_bytes / 2**20:.0f} MiB, {self.most_rows} rows at most"


def span(name: str, text: str) -> tuple[int, int]:
    """MIN-MAX, two positive integers, MIN <= MAX."""
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise UserError(f"{name} takes MIN-MAX like 32-1024, got {text!r}") from None
    if not 1 <= low <= high:
        raise UserError(f"{name} needs 1 <= MIN <= MAX, got {text!r}")
    return low, high
