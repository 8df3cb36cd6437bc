"""Compiling the decode step, one transformer block at a time (regional compilation).

Every layer runs the same code on weights of the same shapes, so one block is compiled once and
every layer reuses the compiled code: the weights are the compiled graph's inputs, not its
constants. A cold compile then costs one block's, not the whole unrolled step's, and the step
keeps its static shapes (the cache is read whole, so one compile serves every token).

The rest of the step (the embedding lookup, RoPE rows, the LM head, sampling) stays eager: a few
ops per token against a few hundred in the blocks. Prefill stays eager too: its shapes change with
every prompt, and its products are large enough that compiling saves little.
"""

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from models.transformer import Transformer

# Vector width of the CPU kernels torch chose for this process (ATEN_CPU_CAPABILITY can lower it).
SIMD_BITS = {"AVX512": 512, "AVX2": 256}


def inductor_options(device: torch.device, tensor_parallel: bool) -> dict[str, object]:
    """On CPU the compiled code's host side is C++ (inductor's cpp_wrapper), which calls a block's
    kernels without Python in between; under tensor parallelism it stays Python, because
    cpp_wrapper cannot call the collectives (torch 2.13).

    The generated code's vector width is that of torch's own kernels. Inductor follows
    ATEN_CPU_CAPABILITY by itself, but its on-disk cache does not key on it: code compiled under
    the AVX-512 kernels was reused under AVX2 and emitted wrong tokens. A width given as an option
    is part of the cache key."""
    if device.type != "cpu":
        return {}
    options: dict[str, object] = {"cpp_wrapper": not tensor_parallel}
    simd_bits = SIMD_BITS.get(torch.backends.cpu.get_cpu_capability())
    if simd_bits is not None:
        options["cpp.simdlen"] = simd_bits
    return options


def run_block(block: nn.Module, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    return block(*args, **kwargs)


def compile_blocks(model: Transformer) -> list[Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    """Each layer's block as a compiled callable, all of them sharing one compiled graph;
    `model(..., layers=...)` runs them in place of the eager blocks."""
    compiled = torch.compile(run_block, fullgraph=True, options=inductor_options(model.device, model.parallel is not None))
    return [partial(compiled, block) for block in model.layers]
