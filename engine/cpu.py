"""CPU tuning of the compiled decode step: the options inductor compiles it with, and the vector
width of the CPU kernels torch chose for this process (ATEN_CPU_CAPABILITY can lower the choice),
which the compiled code takes too. docs/performance.md has the measurements behind each."""

import torch

SIMD_BITS = {"AVX512": 512, "AVX2": 256}


def simd_bits() -> int | None:
    return SIMD_BITS.get(torch.backends.cpu.get_cpu_capability())


def inductor_options(device: torch.device, tensor_parallel: bool) -> dict[str, object]:
    """On CPU the compiled code's host side is C++ (inductor's cpp_wrapper), which calls a block's
    kernels without Python in between; under tensor parallelism it stays Python, because
    cpp_wrapper cannot call the collectives (torch 2.13).

    The generated code's vector width is that of torch's own kernels, given as an option because
    inductor's on-disk cache keys on its options but not on ATEN_CPU_CAPABILITY (docs/performance.md).

    On every device the compiled step rounds where eager rounds (emulate_precision_casts): a
    quantized KV cache's float16 step and minimum are rounded before the codes are computed
    from them, so that a fused kernel computes eager's codes."""
    options: dict[str, object] = {"emulate_precision_casts": True}
    if device.type != "cpu":
        return options
    # vec_isa_ok: take the vector instructions the CPU reports (torch reads its flags) instead of
    # compiling and running a probe program per instruction set in every new process (docs/performance.md).
    options |= {"cpp_wrapper": not tensor_parallel, "cpp.vec_isa_ok": True}
    bits = simd_bits()
    if bits is not None:
        options["cpp.simdlen"] = bits
    return options
