"""A model's key bias, kept out of a quantized cache's codes (kv/quantized.py).

A key is RoPE(W x + b) at its position p, so its bias part is RoPE(b) at p: known exactly from
the position alone. Qwen2's key biases are many times the rest of a key in a few layers, and
codes that have to span them leave the rest of the key a few levels (docs/quantization.md). So
the cache subtracts that part before quantizing and adds it back as it reads, from each slot's
position, which a compaction moves with the slot like its codes.
"""

from typing import NamedTuple

import torch

from models.transformer import Transformer


class KeyBias(NamedTuple):
    """A key bias, the RoPE tables that turn it, and the position each slot holds."""

    bias: torch.Tensor  # [L, 1, H_kv, 1, D] float32 each layer's key bias before RoPE (one layer's: [1, H_kv, 1, D])
    cos: torch.Tensor  # [P, D] the model's RoPE tables
    sin: torch.Tensor  # [P, D]
    positions: torch.Tensor  # [L, B, H_kv, S] int32 the absolute position each slot holds (one layer's: [B, H_kv, S])

    def part(self, positions: torch.Tensor) -> torch.Tensor:
        """The bias part of keys at positions [..., H_kv, S] (or broadcast to it): [..., H_kv, S, D] float32."""
        first, second = self.bias.chunk(2, dim=-1)
        turned = torch.cat((-second, first), dim=-1)  # RoPE's pairs are (i, i + D/2), as in models/rope.py
        return self.bias * self.cos[positions] + turned * self.sin[positions]

    def layer(self, index: int, n_slots: int | None) -> "KeyBias":
        return KeyBias(self.bias[index], self.cos, self.sin, self.positions[index, :, :, :n_slots])


def model_key_bias(model: Transformer, slots: tuple[int, ...], device: torch.device) -> KeyBias | None:
    """The KeyBias of a model whose key projection has a bias, with positions [L, *slots] (the
    cache's slot layout, e.g. [L, B, H_kv, S]) all 0; None without a bias."""
    if not model.config.qkv_bias:
        return None
    attention = model.layers[0].attn
    first = attention.n_heads * attention.head_dim  # wqkv's rows: queries, then keys, then values
    rows = slice(first, first + attention.n_kv_heads * attention.head_dim)
    bias = torch.stack([layer.attn.wqkv.bias[rows].float().view(attention.n_kv_heads, 1, attention.head_dim) for layer in model.layers])
    positions = torch.zeros(len(model.layers), *slots, dtype=torch.int32, device=device)
    return KeyBias(bias[:, None].to(device), model.rope_cos.to(device), model.rope_sin.to(device), positions)
