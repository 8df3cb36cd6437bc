"""Decode attention with flash-attn on CUDA: each row reads only the slots it uses.

Optional: without the `cuda` extra installed, or on CPU, or in float32 (flash-attn computes in
float16/bfloat16 only), the model uses PyTorch's scaled_dot_product_attention instead. A paged
cache is read through its block table when its blocks hold a multiple of 256 slots, the page
size flash-attn requires.
"""

import torch

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:
    flash_attn_with_kvcache = None

FLASH_PAGE_MULTIPLE = 256


def flash_decode_supported(k_cache: torch.Tensor, paged: bool = False) -> bool:
    """k_cache: [B, H_kv, S, D], or one layer's pool [n_blocks, H_kv, block, D] when paged."""
    if paged and k_cache.shape[2] % FLASH_PAGE_MULTIPLE:
        return False
    return flash_attn_with_kvcache is not None and k_cache.is_cuda and k_cache.dtype in (torch.float16, torch.bfloat16)


def flash_decode(
    q: torch.Tensor,  # [B, H, 1, D] after RoPE
    k_cache: torch.Tensor,  # [B, H_kv, S, D], or [n_blocks, H_kv, block, D] with a block table
    v_cache: torch.Tensor,  # like k_cache
    n_valid: torch.Tensor,  # [B] slots in use per row, the new token's included
    block_table: torch.Tensor | None = None,  # [B, max_blocks]
) -> torch.Tensor:
    """Attention output [B, H, 1, D]; flash-attn maps query head h to KV head h // G itself."""
    # flash-attn wants [B, S, H, D] (paged: [n_blocks, block, H, D]); transposed views suffice,
    # as it only needs a unit last stride.
    table = None if block_table is None else block_table.to(torch.int32)
    out = flash_attn_with_kvcache(
        q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), cache_seqlens=n_valid.to(torch.int32), block_table=table
    )
    return out.transpose(1, 2)
