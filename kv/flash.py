"""Decode attention with flash-attn on CUDA: each row reads only the slots it uses.

Optional. `why_not_flash` says when a decode step cannot take it (flash-attn missing, the CPU, a
float32 or quantized cache, queries and cache of different dtypes, a paged block that is not a
multiple of 256 slots, a store to recall from); attention then runs PyTorch's
scaled_dot_product_attention, and the scripts print that reason once (cli.attention_line).
FlashKVCache is the contiguous cache kind whose views take flash-attn in a decode step; the
paged kind's views take it through the block table (kv/paged.py).
Each condition is one of flash-attn's own checks in `mha_fwd_kvcache` (flash_api.cpp).

The kernel is called through a torch custom op with a fake implementation: flash-attn's
`flash_attn_with_kvcache` calls its C++ extension directly, which torch.compile cannot trace, so
the op is what lets a compiled step (fullgraph) hold it.
"""

import functools
import re

import torch

from kv.cache import KVCache, RowsView

FLASH_PAGE_MULTIPLE = 256  # flash-attn reads a paged cache in pages of a multiple of 256 slots
FLASH_MAX_HEAD_DIM = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# The newest release whose paged decode was read and found free of host syncs. Later sources read
# the longest row back to the host on the paged path (flash-attn PR #2711), which a CUDA graph
# cannot capture; pyproject's `cuda` extra pins flash-attn to these releases.
FLASH_CHECKED_UP_TO = (2, 8, 3)

try:
    import flash_attn
    from flash_attn import flash_attn_with_kvcache as kernel
except ImportError as e:  # not installed, or built for another torch (an ABI mismatch)
    flash_attn, kernel = None, None
    MISSING = "flash-attn is not installed (the `cuda` extra)" if getattr(e, "name", None) == "flash_attn" else f"flash-attn failed to import ({e})"
else:
    MISSING = None


@functools.cache
def release(version: str) -> tuple[int, ...]:
    """'2.8.3.post1' -> (2, 8, 3): the release a version string names."""
    return tuple(int(n) for n in re.findall(r"\d+", version)[:3])


def why_not_flash(
    device: torch.device, q_dtype: torch.dtype, cache_dtype: torch.dtype | None, head_dim: int, block_size: int | None, store: bool
) -> str | None:
    """Why a decode step's attention cannot go to flash-attn, or None when it can.
    cache_dtype: the cache's floats, None when it holds codes (--kv-dtype int8, k4v3, ...); block_size: a paged
    cache's slots per block, None for the contiguous cache; store: a --kv-store to recall from."""
    if device.type != "cuda":  # first and cheap: an eager CPU step asks for every layer
        return "flash-attn runs on CUDA only"
    if kernel is None:
        return MISSING
    if cache_dtype is None:
        return "the cache holds quantized codes (--kv-dtype), which flash-attn does not read"
    if store:
        return "--kv-store attends over recalled slots in the same softmax, which flash-attn does not"
    if cache_dtype not in FLASH_DTYPES:
        return f"the cache holds {dtype_name(cache_dtype)}; flash-attn reads float16 and bfloat16 only"
    if q_dtype != cache_dtype:
        return f"the model computes in {dtype_name(q_dtype)} and the cache holds {dtype_name(cache_dtype)}; flash-attn takes one dtype for both (--kv-dtype auto)"
    if head_dim > FLASH_MAX_HEAD_DIM:
        return f"heads of {head_dim} channels; flash-attn takes at most {FLASH_MAX_HEAD_DIM}"
    if block_size is not None:
        if block_size % FLASH_PAGE_MULTIPLE:
            return f"the paged cache's blocks hold {block_size} slots; flash-attn reads pages of a multiple of {FLASH_PAGE_MULTIPLE} (--block-size {FLASH_PAGE_MULTIPLE})"
        if release(flash_attn.__version__) > FLASH_CHECKED_UP_TO:
            return f"flash-attn {flash_attn.__version__}'s paged decode syncs with the host, which a CUDA graph cannot capture (checked up to 2.8.3)"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@torch.library.custom_op("engine::flash_decode", mutates_args=())
def flash_decode_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, block_table: torch.Tensor | None
) -> torch.Tensor:
    """flash-attn's decode over a cache it only reads: the arguments in its own layout, q [B, 1, H, D]
    contiguous, the output the same."""
    return kernel(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table).contiguous()


@flash_decode_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table):
    return torch.empty_like(q)


def flash_decode(
    q: torch.Tensor,  # [B, H, 1, D] after RoPE
    k_cache: torch.Tensor,  # [B, H_kv, S, D], or [n_blocks, H_kv, block, D] with a block table
    v_cache: torch.Tensor,  # like k_cache
    n_valid: torch.Tensor,  # [B] slots in use per row, the new token's included
    block_table: torch.Tensor | None = None,  # [B, max_blocks]
) -> torch.Tensor:
    """Attention output [B, H, 1, D]; flash-attn maps query head h to KV head h // G itself."""
    # flash-attn wants [B, S, H, D] (paged: [n_blocks, block, H, D]); transposed views suffice for
    # the cache, as it only needs a unit last stride.
    table = None if block_table is None else block_table.to(torch.int32)
    q = q.transpose(1, 2).contiguous()  # [B, 1, H, D]
    out = flash_decode_op(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), n_valid.to(torch.int32), table)
    return out.transpose(1, 2)


class FlashRowsView(RowsView):
    """One layer of a contiguous float cache on CUDA: a decode step reads each row's slots in use
    (the new token's slot + 1) with flash-attn where it can, SDPA otherwise."""

    def attend(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, before_rope: torch.Tensor) -> torch.Tensor:
        if q.shape[2] == 1 and why_not_flash(q.device, q.dtype, self.k.dtype, q.shape[-1], None, False) is None:
            return flash_decode(q, self.k, self.v, slots[:, 0] + 1)
        return super().attend(q, slots, mask, before_rope)


class FlashKVCache(KVCache):
    view = FlashRowsView
