"""The argument checks of the CUDA kernels the engine calls, transcribed from their sources, so that
what the engine would hand them can be checked on a machine without CUDA.

- torch, aten/src/ATen/native/cuda/int4mm.cu: `_convert_weight_to_int4pack_cuda`,
  `_weight_int4pack_mm_cuda` (and the `launch_tinygemm_kernel` it calls);
- torch, aten/src/ATen/native/cuda/int8mm.cu: `_weight_int8pack_mm_cuda`;
- flash-attn 2.8.3, csrc/flash_attn/flash_api.cpp: `mha_fwd_kvcache`, behind `flash_attn_with_kvcache`.

Each function returns the checks a call fails (the source's message, or its condition where it has
none); an empty list is a call the kernel accepts.
"""

from collections.abc import Sequence

import torch

K_TILE = 16  # kKTileSize
N_TILE = 8  # kNTileSize on CUDA
K_TILES_PER_WARP = 8  # the tinygemm launch's fixed KTilesPerWarp
FLASH_PAGE = 256


def even_divisor(num: int, denom: int) -> bool:
    return num >= denom and num % denom == 0


def convert_weight_to_int4pack(packed_pairs: torch.Tensor, inner_k_tiles: int) -> list[str]:
    """packed_pairs: [N, K / 2] uint8, two 4-bit values a byte."""
    fails = []
    if packed_pairs.dim() != 2:
        fails.append("in.dim() == 2")
    if packed_pairs.dtype != torch.uint8:
        fails.append("in.dtype() == at::kByte")
    if inner_k_tiles not in (2, 4, 8):
        fails.append("innerKTiles == 2 || innerKTiles == 4 || innerKTiles == 8")
    elif not even_divisor(packed_pairs.shape[1] * 2, inner_k_tiles * K_TILE):
        fails.append("isEvenDivisor(in.size(1) * 2, innerKTiles * kKTileSize)")
    return fails


def weight_int4pack_mm(a: torch.Tensor, b: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> list[str]:
    """a: [M, K] activations; b: the packed weight [N / 8, K / (16 * inner), 32, inner / 2] int32;
    scales_and_zeros: [K / group, N, 2]."""
    fails = []
    inner = b.shape[3] * 2 if b.dim() == 4 else 0
    if inner not in (2, 4, 8):
        fails.append("B_innerKTiles == 2 || B_innerKTiles == 4 || B_innerKTiles == 8")
    if a.dtype != torch.bfloat16:
        fails.append("A.dtype() == at::kBFloat16")
    if a.dim() != 2:
        fails.append("A.dim() == 2")
    if b.dtype != torch.int32 or b.dim() != 4:
        fails.append("B.dtype() == at::kInt && B.dim() == 4")
    if fails:
        return fails
    k, n = a.shape[1], b.shape[0] * N_TILE
    k_tiles = -(-k // K_TILE)
    if b.shape[1] != k // (inner * K_TILE):
        fails.append("B.size(1) == k / (B_innerKTiles * kKTileSize)")
    if b.shape[2] != 32:
        fails.append("B.size(2) == 32")
    if group_size not in (32, 64, 128, 256):
        fails.append("qGroupSize == 32 || qGroupSize == 64 || qGroupSize == 128 || qGroupSize == 256")
    if not even_divisor(k_tiles * K_TILE, group_size):
        fails.append("kTiles * kKTileSize >= qGroupSize && isEvenDivisor(kTiles * kKTileSize, qGroupSize)")
    if scales_and_zeros.dim() != 3 or scales_and_zeros.shape[1] != n or scales_and_zeros.shape[2] != 2:
        fails.append("qScaleAndZeros.dim() == 3 && qScaleAndZeros.size(1) == n && qScaleAndZeros.size(2) == 2")
    if scales_and_zeros.dtype != torch.bfloat16:  # not checked: the kernel reads it as __nv_bfloat16
        fails.append("qScaleAndZeros is read as bfloat16")
    if not even_divisor(k_tiles, inner):
        fails.append("kTiles >= BLayout::kInnerKTiles && isEvenDivisor(kTiles, BLayout::kInnerKTiles)")
    if not even_divisor(K_TILES_PER_WARP, inner):
        fails.append("KTilesPerWarp >= BLayout::kInnerKTiles && isEvenDivisor(KTilesPerWarp, BLayout::kInnerKTiles)")
    return fails


def weight_int8pack_mm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> list[str]:
    """x: [M, K] any float dtype (the kernel computes in float32); w: [N, K] int8; scales: [N]."""
    fails = []
    if x.dim() != 2:
        fails.append("x must be 2D")
    if w.dim() != 2:
        fails.append("w must be 2D")
    if scales.dim() != 1:
        fails.append("scale must be 1D")
    if fails:
        return fails
    if x.shape[1] != w.shape[1]:
        fails.append("K dimension mismatch: x.size(1) != w.size(1)")
    if w.shape[0] != scales.shape[0]:
        fails.append("Output dim mismatch: w.size(0) != scale.size(0)")
    if w.dtype != torch.int8:
        fails.append("w is read as int8")
    return fails


def flash_fwd_kvcache(
    q: torch.Tensor,  # [B, 1, H, D]
    k_cache: torch.Tensor,  # [B, S, H_kv, D], or paged [n_blocks, block, H_kv, D]
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,  # [B]
    block_table: torch.Tensor | None,  # [B, max_blocks]
    capability: tuple[int, int] = (9, 0),
) -> list[str]:
    fails = []
    if capability[0] < 8:
        fails.append("FlashAttention only supports Ampere GPUs or newer.")
    if q.dtype not in (torch.float16, torch.bfloat16):
        fails.append("FlashAttention only support fp16 and bf16 data type")
    if k_cache.dtype != q.dtype:
        fails.append("query and key must have the same dtype")
    if v_cache.dtype != q.dtype:
        fails.append("query and value must have the same dtype")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache)):
        fails.append("Input tensor must have contiguous last dimension")
    batch, seqlen_q, heads, head_dim = q.shape
    if block_table is not None:
        if block_table.dtype != torch.int32:
            fails.append("block_table must have dtype torch.int32")
        if block_table.stride(-1) != 1:
            fails.append("block_table must have contiguous last dimension")
        if k_cache.shape[1] % FLASH_PAGE:
            fails.append("Paged KV cache block size must be divisible by 256")
        if tuple(block_table.shape[:1]) != (batch,):
            fails.append("block_table must have shape (batch_size, max_num_blocks_per_seq)")
    elif k_cache.shape[0] != batch:
        fails.append("k_cache must have shape (batch_size_c, seqlen_k, num_heads_k, head_size_og)")
    if head_dim > 256:
        fails.append("FlashAttention forward only supports head dimension at most 256")
    heads_k = k_cache.shape[2]
    if heads % heads_k:
        fails.append("Number of heads in key/value must divide number of heads in query")
    if k_cache.shape[3] != head_dim or tuple(v_cache.shape) != tuple(k_cache.shape):
        fails.append("k_cache/v_cache must have shape (..., num_heads_k, head_size_og)")
    if cache_seqlens.dtype != torch.int32:
        fails.append("seqlens_k must have dtype int32")
    if not cache_seqlens.is_contiguous():
        fails.append("seqlens_k must be contiguous")
    if tuple(cache_seqlens.shape) != (batch,):
        fails.append("seqlens_k must have shape (batch_size)")
    return fails


RULES = {
    "aten._convert_weight_to_int4pack.default": convert_weight_to_int4pack,
    "aten._weight_int4pack_mm.default": weight_int4pack_mm,
    "aten._weight_int8pack_mm.default": weight_int8pack_mm,
    "engine.flash_decode.default": flash_fwd_kvcache,
}


def failed_checks(calls: Sequence[tuple[str, tuple]]) -> list[str]:
    """Every check the recorded kernel calls (op name, arguments) fail, each named with its call."""
    return [f"{name}: {fail}" for name, args in calls for fail in RULES[name](*args)]
