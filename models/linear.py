"""The model's linear layer: nn.Linear, except for products of many rows in 16-bit floats on
CPUs without 16-bit matrix instructions.

Such a CPU (AVX2 without AVX512-BF16 or AMX) multiplies bfloat16 matrices one row at a time, so
a prefill is faster with the weight converted to float32 (docs/performance.md). The float32
product multiplies the same values exactly and accumulates in float32 as the 16-bit kernel does,
so only the rounding of the output can differ (by one unit in the last place). With a few rows
(decode) the 16-bit kernel is faster, because converting the weight costs more than the product.
"""

import torch
import torch.nn.functional as F
from torch import nn

FLOAT32_FROM_ROWS = 8  # the measured crossover (docs/performance.md)


# Whether this CPU multiplies 16-bit float matrices in hardware, as oneDNN reports it, and torch
# runs its AVX-512 kernels (under ATEN_CPU_CAPABILITY=avx2 it holds to what an AVX2 CPU has): a
# fact of the process, read once (a plain dict lookup is also what torch.compile can trace).
_AVX512_KERNELS = torch.backends.cpu.get_cpu_capability() != "AVX2"
NATIVE_CPU_MATMUL = {
    torch.bfloat16: _AVX512_KERNELS and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    torch.float16: _AVX512_KERNELS and torch.ops.mkldnn._is_mkldnn_fp16_supported(),
}


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C_in]
        rows = x.numel() // x.shape[-1]
        if rows >= FLOAT32_FROM_ROWS and x.device.type == "cpu" and not NATIVE_CPU_MATMUL.get(x.dtype, True):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def column_major_on_cpu(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a float32 weight [out, in] is stored column-major (its memory laid out as [in, out]):
    batch-1 float32 products on CPU read a wide matrix (more outputs than inputs) faster that way
    and a tall one slower (docs/performance.md). The 16-bit kernels are fastest with the
    checkpoint's row-major layout, which they keep."""
    return device.type == "cpu" and dtype == torch.float32 and len(shape) == 2 and shape[0] > shape[1]
