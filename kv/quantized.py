"""A quantized KV cache's storage: keys (after RoPE) and values in 8 or 4 bits.

Each slot's D channels are quantized in groups of KV_GROUP (or the whole head when it is
smaller), each group with its own step and minimum in float16, the layout llama.cpp's q8_0/q4_1
blocks use along a row. Per slot, not per channel across slots (KIVI's keys), because slots move
one by one: a compaction moves each kept slot with its own scales, and a decode step writes one
slot at a time, so no group ever mixes a kept slot with an evicted one or waits for its other
members (docs/design.md). The price, measured: keys with a few very large channels (Qwen2's) lose
much in 4 bits (docs/quantization.md).

A quantized cache kind is the contiguous one (kv/cache.py) over these buffers: its views write
codes and read the slots back dequantized, in the queries' dtype, just before attention.
"""

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from errors import UserError
from kv import KV_BITS, KV_DTYPES
from kv.cache import KVCache, RowsView, counters
from models.config import ModelConfig

KV_GROUP = 32  # channels sharing one step and minimum (a smaller head is one group)


class QuantizedKV(NamedTuple):
    """One cache buffer's keys or values; every part is indexed by slot like the float buffer it
    replaces, [..., S, ...], only the last dimension differs."""

    codes: torch.Tensor  # [..., S, D * bits // 8] uint8; int4 two per byte, the even channel in the low nibble
    step: torch.Tensor  # [..., S, groups] float16
    low: torch.Tensor  # [..., S, groups] float16, at or below every value of the group
    bits: int  # 8 or 4

    @property
    def parts(self) -> list[torch.Tensor]:
        return [self.codes, self.step, self.low]

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * 8 // self.bits

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedKV":
        """The same slots of every part: fn indexes (or allocates) by the leading dimensions only."""
        return QuantizedKV(fn(self.codes), fn(self.step), fn(self.low), self.bits)


KV = torch.Tensor | QuantizedKV  # a cache buffer, float or quantized


def allocate_keys_and_values(shape: tuple[int, ...], dtype: torch.dtype, bits: tuple[int, int] | None, device: torch.device) -> tuple[KV, KV]:
    """Zeros for the keys and the values of slots of `shape` [..., S, D], each float in `dtype` or in
    codes of its own bits (kv_storage's)."""
    key_bits, value_bits = bits or (None, None)
    return allocate_kv(shape, dtype, key_bits, device), allocate_kv(shape, dtype, value_bits, device)


def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, bits: int | None, device: torch.device) -> KV:
    """Zeros for slots of `shape` [..., S, D]: float in `dtype`, or `bits`-bit codes."""
    if bits is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    *slots, D = shape
    group = min(KV_GROUP, D)
    if D % group or D % 2:
        raise UserError(f"a quantized KV cache needs a head dimension divisible by {KV_GROUP} (or an even one below it), and this model's is {D}; use --kv-dtype auto")
    return QuantizedKV(
        torch.zeros(*slots, D * bits // 8, dtype=torch.uint8, device=device),
        torch.zeros(*slots, D // group, dtype=torch.float16, device=device),
        torch.zeros(*slots, D // group, dtype=torch.float16, device=device),
        bits,
    )


def quantize(x: torch.Tensor, bits: int) -> QuantizedKV:
    """x [..., D] -> codes and each group's step and minimum. The float16 minimum is rounded down
    and the step up, so every value lies in the range the codes span: each comes back within half
    a step of itself (the test's bound)."""
    levels = 2**bits - 1
    groups = x.float().unflatten(-1, (-1, min(KV_GROUP, x.shape[-1])))  # [..., D / G, G]
    low, high = groups.amin(-1), groups.amax(-1)
    # float16 rounds to nearest within 2^-11 of a value (2^-25 below its normal range): push the
    # value that far out first, and the rounding cannot come back past it.
    low = (low - low.abs() * 2**-11 - 2**-24).half()
    step = (((high - low.float()) / levels) * (1 + 2**-10) + 2**-24).half()
    codes = ((groups - low.float()[..., None]) / step.float()[..., None]).round().clamp(0, levels).to(torch.uint8).flatten(-2)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedKV(codes, step, low, bits)


def dequantize(q: QuantizedKV, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D * bits // 8] -> values [..., D] in `dtype`."""
    groups = _codes(q).unflatten(-1, (q.step.shape[-1], -1))  # [..., D / G, G]
    return torch.addcmul(q.low.float()[..., None], groups, q.step.float()[..., None]).flatten(-2).to(dtype)


def kv_map(kv: KV, fn: Callable[[torch.Tensor], torch.Tensor]) -> KV:
    """fn on a float buffer, or on each part of a quantized one."""
    return kv.map(fn) if isinstance(kv, QuantizedKV) else fn(kv)


def kv_parts(kv: KV) -> list[torch.Tensor]:
    """The tensors that hold a buffer's slots (what a compaction moves)."""
    return kv.parts if isinstance(kv, QuantizedKV) else [kv]


def kv_unbind(kv: KV) -> list[KV]:
    """A buffer of every layer [L, ...] as one per layer."""
    if isinstance(kv, QuantizedKV):
        return [QuantizedKV(*parts, kv.bits) for parts in zip(*(part.unbind(0) for part in kv.parts))]
    return list(kv.unbind(0))


def kv_nbytes(kv: KV) -> int:
    return sum(part.nbytes for part in kv_parts(kv))


def kv_store(kv: KV, index: tuple, values: torch.Tensor) -> None:
    """kv[index] = values [..., D], quantized for a quantized buffer (index names leading dims only)."""
    if isinstance(kv, QuantizedKV):
        for part, new in zip(kv.parts, quantize(values, kv.bits).parts):
            part[index] = new
    else:
        kv[index] = values.to(kv.dtype)


def kv_read(kv: KV, dtype: torch.dtype) -> torch.Tensor:
    """The values [..., D] in `dtype`, the model's."""
    return dequantize(kv, dtype) if isinstance(kv, QuantizedKV) else kv.to(dtype)


def kv_shape(kv: KV) -> torch.Size:
    """The shape of the values a buffer holds, [..., S, D]."""
    if isinstance(kv, QuantizedKV):
        return torch.Size((*kv.codes.shape[:-1], kv.head_dim))
    return kv.shape



def kv_storage(kv_dtype: str, model_dtype: torch.dtype) -> tuple[torch.dtype, tuple[int, int] | None]:
    """--kv-dtype as (the dtype keys and values read back in, the bits of the keys' and the
    values' codes, or None for floats). auto: the model's dtype, as floats."""
    if kv_dtype == "auto":
        return model_dtype, None
    if kv_dtype in KV_BITS:
        return model_dtype, KV_BITS[kv_dtype]
    if kv_dtype in KV_DTYPES:
        return KV_DTYPES[kv_dtype], None
    raise UserError(f"unknown --kv-dtype {kv_dtype!r}; choose one of auto, {', '.join([*KV_DTYPES, *KV_BITS])}")


def _codes(q: QuantizedKV) -> torch.Tensor:
    """The codes one per channel, [..., D], as floats."""
    codes = q.codes
    if q.bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)
    return codes.float()


class QuantizedRowsView(RowsView):
    """One layer of a quantized contiguous cache: codes in, floats out."""

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        index = (rows, slice(None), slots)  # [B, T, H_kv, D] into slots [B, T]
        kv_store(self.k, index, k.transpose(1, 2))
        kv_store(self.v, index, v.transpose(1, 2))

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_read(self.k, dtype), kv_read(self.v, dtype)

    def slots_read(self) -> list[tuple[torch.Tensor, int]]:
        return [(part, 2) for part in kv_parts(self.k) + kv_parts(self.v)]  # [B, H_kv, S, ...]


class QuantizedKVCache(KVCache):
    """The contiguous cache with keys and values in codes (QuantizedKV), read back in `dtype`."""

    view = QuantizedRowsView

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, n_slots: int, dtype: torch.dtype, device: torch.device, bits: tuple[int, int]) -> "QuantizedKVCache":
        shape = (config.n_layers, batch, config.n_kv_heads, n_slots, config.head_dim)
        return cls(*allocate_keys_and_values(shape, dtype, bits, device), *counters(batch, device), torch.arange(n_slots, device=device), dtype)

    def slot_shape(self) -> tuple[int, int, int, int, int]:
        return tuple(kv_shape(self.k))

    def buffers(self) -> list[torch.Tensor]:
        return kv_parts(self.k) + kv_parts(self.v)

    def layers(self, n_slots: int | None) -> list[QuantizedRowsView]:
        k, v = self.k, self.v
        if n_slots is not None:
            k, v = (kv_map(kv, lambda t: t[:, :, :, :n_slots]) for kv in (k, v))
        return [self.view(*layer) for layer in zip(kv_unbind(k), kv_unbind(v))]

    def keys(self, layer: int, n_slots: int) -> torch.Tensor:
        return kv_read(kv_map(self.k, lambda t: t[layer, :, :, :n_slots]), self.dtype)

    def all_keys(self) -> torch.Tensor:
        return kv_read(self.k, self.dtype)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def pick(part: torch.Tensor) -> torch.Tensor:
            return part.gather(3, slots[..., None].expand(*slots.shape, part.shape[-1]))

        return kv_read(kv_map(self.k, pick), self.dtype), kv_read(kv_map(self.v, pick), self.dtype)

    def row(self, b: int) -> "QuantizedKVCache":
        rows = slice(b, b + 1)
        k, v = (kv_map(kv, lambda t: t[:, rows]) for kv in (self.k, self.v))
        return replace(self, k=k, v=v, length=self.length[rows], position=self.position[rows], prompt_length=self.prompt_length[rows])


def contiguous_cache(config: ModelConfig, batch: int, n_slots: int, kv_dtype: str, model_dtype: torch.dtype, device: torch.device) -> KVCache:
    """The contiguous cache --kv-dtype asks for: floats, or codes read back in the model's dtype."""
    dtype, bits = kv_storage(kv_dtype, model_dtype)
    if bits is None:
        return KVCache.allocate(config, batch, n_slots, dtype, device)
    return QuantizedKVCache.allocate(config, batch, n_slots, dtype, device, bits)
