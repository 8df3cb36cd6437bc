"""The vector width of the CPU kernels torch chose for this process (ATEN_CPU_CAPABILITY can
lower the choice), which the compiled code takes too (engine/compile.py)."""

import torch

SIMD_BITS = {"AVX512": 512, "AVX2": 256}


def simd_bits() -> int | None:
    return SIMD_BITS.get(torch.backends.cpu.get_cpu_capability())
