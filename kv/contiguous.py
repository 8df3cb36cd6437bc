"""The contiguous cache --kv-dtype asks for: floats (kv/cache.py), codes per slot
(kv/quantized.py) or keys per channel (kv/channel_keys.py)."""

import torch

from kv import KV_CHANNEL_CODES
from kv.cache import KVCache
from kv.channel_keys import ChannelKeysKVCache
from kv.key_bias import model_key_bias
from kv.quantized import QuantizedKVCache, kv_storage
from models.transformer import Transformer


def contiguous_cache(model: Transformer, batch: int, n_slots: int, kv_dtype: str, device: torch.device) -> KVCache:
    """`batch` rows of n_slots slots, read back in the model's dtype (a model's key bias, if any,
    kept out of per-slot codes)."""
    dtype, bits, group = kv_storage(kv_dtype, model.dtype)
    if bits is None:
        return KVCache.allocate(model.config, batch, n_slots, dtype, device)
    if kv_dtype in KV_CHANNEL_CODES:
        return ChannelKeysKVCache.allocate(model.config, batch, n_slots, dtype, device, bits, group)
    key_bias = model_key_bias(model, (batch, model.config.n_kv_heads, n_slots), device)
    return QuantizedKVCache.allocate(model.config, batch, n_slots, dtype, device, bits, key_bias, group)
