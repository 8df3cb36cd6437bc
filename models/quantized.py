"""Weight-only quantized linear layers: int8 per output channel, int4 per group of inputs.

A decode step at batch 1 reads every weight once per token, so its speed is the bytes it reads.
These layers keep the weights in 8 or 4 bits and multiply them with 16/32-bit activations in one
kernel, never materialising the float weight (but for a prefill's many rows of int8 on CUDA,
whose product goes to cuBLAS on a float copy):

- int8: w[n, k] = q[n, k] * scale[n], q in -127..127 (symmetric).
- int4: w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], q in 0..15, g = k // group_size.
  This is the form torch's int4 kernels compute, and GGUF's 4-bit blocks map onto it exactly
  (weights/gguf_blocks.py).

`QuantizedWeight` is the portable form (what a quantized checkpoint stores); a layer packs it
into its kernel's layout for the device when it is built.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from errors import UserError
from models import GROUP_SIZES
INT4_ROWS_MULTIPLE = 16  # torch's int4 packing takes output sizes that are multiples of 16
INT4_K_TILE = 16  # torch's CUDA int4 layout cuts K into tiles of 16 inputs...
CUDA_INT4_INNER_K_TILES = (8, 4, 2)  # ...packed 8, 4 or 2 tiles together; K must be a multiple of the packing
CPU_INT4_INNER_K_TILES = 2  # the CPU kernel ignores the tiling; any valid value packs the same
# torch's CUDA int8 product is a plain kernel on the CUDA cores: for the few rows of a decode step it
# reads the int8 weight once; a prefill's many rows go to cuBLAS on a float copy, whose cost they
# share. Where the two cross is unmeasured (docs/gpu.md).
CUDA_INT8_KERNEL_ROWS = 16


@dataclass
class QuantizedWeight:
    """A weight [N, K] in the portable form: w[n, k] = values[n, k] * scales[n, g] + zeros[n, g],
    with g = k // (K / G). int8 has one group per row and no zeros; int4 has zeros."""

    values: torch.Tensor  # [N, K] int8: -127..127 (int8) or -8..7 (int4)
    scales: torch.Tensor  # [N, G] float32
    zeros: torch.Tensor | None = None  # [N, G] float32, int4 only

    @property
    def mode(self) -> str:
        return "int8" if self.zeros is None else "int4"

    @property
    def group_size(self) -> int:
        return self.values.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these values stand for."""
        w = self.values.float() * self.scales.repeat_interleave(self.group_size, dim=1)
        return w if self.zeros is None else w + self.zeros.repeat_interleave(self.group_size, dim=1)


def concatenate(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The weights stacked along rows (a fused projection). Parts of different modes or group sizes
    (a GGUF file mixes block types) become int8 per channel: the finer of the two modes."""
    if len({(p.mode, p.group_size) for p in parts}) > 1:
        return quantize_int8(torch.cat([p.dequantize() for p in parts]))
    zeros = None if parts[0].zeros is None else torch.cat([p.zeros for p in parts])
    return QuantizedWeight(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]), zeros)


def quantize(weight: torch.Tensor, mode: str, group_size: int) -> QuantizedWeight:
    return quantize_int8(weight) if mode == "int8" else quantize_int4(weight, group_size)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per output channel: the largest magnitude of each row becomes 127."""
    w = weight.float()  # [N, K]
    scales = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127  # [N, 1]
    return QuantizedWeight((w / scales).round().clamp(-127, 127).to(torch.int8), scales)


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Asymmetric per group of `group_size` inputs: each group's minimum and maximum map to -8 and 7."""
    N, K = weight.shape
    w = weight.float().view(N, K // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    scales = (high - low).clamp(min=1e-12) / 15
    values = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15) - 8
    return QuantizedWeight(values.to(torch.int8).view(N, K), scales, zeros=low + 8 * scales)


def check_int4_fits(shapes: dict[str, tuple[int, int]], group_size: int) -> None:
    """One clear error when torch's int4 kernels cannot take every weight [N, K] of `shapes` (by name)
    in groups of `group_size`; its hint names a group size that fits them all."""
    for name, (N, K) in shapes.items():
        if K % group_size:
            fits = [g for g in GROUP_SIZES if all(k % g == 0 for _, k in shapes.values())]
            hint = f"use --group-size {fits[-1]}" if fits else "use --quant int8"
            raise UserError(f"--quant int4 --group-size {group_size}: {name} has {K} inputs, not a multiple of {group_size}; {hint}")
        if N % INT4_ROWS_MULTIPLE:
            raise UserError(f"--quant int4: {name} has {N} outputs, torch's int4 kernel takes multiples of {INT4_ROWS_MULTIPLE}; use --quant int8")


def cuda_int4_inner_k_tiles(in_features: int) -> int:
    """How many 16-input tiles torch's CUDA int4 packing holds together for a weight of `in_features`
    inputs: the most (8, as gpt-fast packs) that divides them. torch requires K to be a multiple of
    16 * inner k-tiles (SmolLM2's 576 takes 4); any K that is a multiple of a group size (32) fits 2."""
    for tiles in CUDA_INT4_INNER_K_TILES:
        if in_features % (tiles * INT4_K_TILE) == 0:
            return tiles
    raise UserError(f"an int4 weight with {in_features} inputs cannot be packed for CUDA (a multiple of 32 is needed); use --quant int8")


def check_int4_activations(device: torch.device, dtype: torch.dtype) -> None:
    """torch's CUDA int4 product takes bfloat16 activations only (its CPU one takes any float)."""
    if device.type == "cuda" and dtype != torch.bfloat16:
        raise UserError(f"4-bit weights run on CUDA with bfloat16 activations only (torch's int4 kernel), not {str(dtype).removeprefix('torch.')}; use --dtype bfloat16 (or auto)")


class Int8Linear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.out_features, self.in_features = weight.values.shape
        self.register_buffer("weight", weight.values.to(device))  # [N, K] int8
        self.register_buffer("scales", weight.scales[:, 0].to(device, dtype))  # [N]
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K]
        rows = x.reshape(-1, self.in_features)
        if x.device.type != "cpu" and rows.shape[0] > CUDA_INT8_KERNEL_ROWS:
            out = F.linear(rows, self.weight.to(x.dtype)) * self.scales
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        super().__init__()
        check_int4_activations(device, dtype)
        self.out_features, self.in_features = weight.values.shape
        self.group_size = weight.group_size
        values = weight.values.to(device, torch.int32) + 8  # [N, K] in 0..15, the kernels' range
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, CPU_INT4_INNER_K_TILES)
        else:  # the CUDA packing takes two values per byte, the first in the high nibble
            pairs = (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8)  # [N, K/2]
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, cuda_int4_inner_k_tiles(self.in_features))
        self.register_buffer("weight", packed)
        scales_and_zeros = torch.stack([weight.scales, weight.zeros], dim=-1).transpose(0, 1)  # [K/g, N, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(device, dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K]
        rows = x.reshape(-1, self.in_features)
        if x.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, self.scales_and_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm(rows, self.weight, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """A lookup table stored int8 per row, each looked-up row scaled back to the activation dtype.
    A tied model's embedding shares its table with the int8 LM head: the same rows, one copy."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)  # [V, C] int8
        self.register_buffer("scales", scales)  # [V]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, C]
        return self.weight[tokens].to(self.scales.dtype) * self.scales[tokens, None]


def quantized_linear(weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
    layer = Int8Linear if weight.mode == "int8" else Int4Linear
    return layer(weight, bias, dtype, device)
