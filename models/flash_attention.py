"""Decode attention with flash-attn on CUDA: each row reads only the slots it uses.

Optional: without the `cuda` extra installed, or on CPU, or in float32 (flash-attn computes in
float16/bfloat16 only), the model uses PyTorch's scaled_dot_product_attention instead.
"""

import torch

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:
    flash_attn_with_kvcache = None


def flash_decode_supported(k_cache: torch.Tensor) -> bool:
    return flash_attn_with_kvcache is not None and k_cache.is_cuda and k_cache.dtype in (torch.float16, torch.bfloat16)


def flash_decode(
    q: torch.Tensor,  # [B, H, 1, D] after RoPE
    k_cache: torch.Tensor,  # [B, H_kv, S, D]
    v_cache: torch.Tensor,  # [B, H_kv, S, D]
    n_valid: torch.Tensor,  # [B] slots in use per row, the new token's included
) -> torch.Tensor:
    """Attention output [B, H, 1, D]; flash-attn maps query head h to KV head h // G itself."""
    # flash-attn wants [B, S, H, D]; transposed views suffice, as it only needs a unit last stride.
    out = flash_attn_with_kvcache(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), cache_seqlens=n_valid.to(torch.int32))
    return out.transpose(1, 2)
