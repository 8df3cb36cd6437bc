"""What every system is asked to do (a Workload) and what one timed run of it gives back (a Trial).

The prompt is `batch` rows of random token ids, the same for every system; no EOS stops a run,
so every run makes exactly `new_tokens` tokens per row.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from compression.config import CompressionConfig


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


def progress(message: str) -> None:
    """Progress goes to stderr, so that stdout carries the report alone."""
    print(message, file=sys.stderr, flush=True)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
