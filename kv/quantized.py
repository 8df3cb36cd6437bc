"""A quantized KV cache's storage: keys (after RoPE) and values in codes of 8, 4, 3 or 2 bits.

Each slot's D channels are quantized in groups of KV_GROUP (64 with the `g64` names; or the whole head when it is
smaller), each group with its own step and minimum in float16, the layout llama.cpp's q8_0/q4_1
blocks use along a row. Per slot, not per channel across slots (KIVI's keys), because slots move
one by one: a compaction moves each kept slot with its own scales, and a decode step writes one
slot at a time, so no group ever mixes a kept slot with an evicted one or waits for its other
members (docs/design.md). Two things make keys fit fewer bits (docs/quantization.md):
- a model's key bias (Qwen2's) is taken out before quantizing and put back from the slot's
  position (kv/key_bias.py): it is known exactly, and it dwarfs the rest of a key in a few layers;
- keys below 8 bits are turned by an orthogonal rotation (a Hadamard matrix over the head's
  channels), which spreads a few large channels over all of them, so that one group's range no
  longer has to span an outlier. q.k is unchanged, and a slot stays self-contained.

A quantized cache kind is the contiguous one (kv/cache.py) over these buffers: its views write
codes and read the slots back dequantized, in the queries' dtype, just before attention.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from errors import UserError
from kv import KV_BITS, KV_CHANNEL_CODES, KV_DTYPES
from kv.cache import KVCache, counters, sdpa
from kv.key_bias import KeyBias
from models.config import ModelConfig

KV_GROUP = 32  # channels sharing one step and minimum (a smaller head is one group)


class QuantizedKV(NamedTuple):
    """One cache buffer's keys or values; every part is indexed by slot like the float buffer it
    replaces, [..., S, ...], only the last dimension differs."""

    codes: torch.Tensor  # [..., S, D * bits // 8] uint8, laid out as pack_codes says
    step: torch.Tensor  # [..., S, groups] float16
    low: torch.Tensor  # [..., S, groups] float16, at or below every value of the group
    bits: int  # 8, 4, 3 or 2
    rotation: torch.Tensor | None = None  # [D, D] orthogonal, float32: the codes hold x @ rotation; None: x itself

    @property
    def parts(self) -> list[torch.Tensor]:
        return [self.codes, self.step, self.low]

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * 8 // self.bits

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedKV":
        """The same slots of every part: fn indexes (or allocates) by the leading dimensions only."""
        return QuantizedKV(fn(self.codes), fn(self.step), fn(self.low), self.bits, self.rotation)


KV = torch.Tensor | QuantizedKV  # a cache buffer, float or quantized


def allocate_keys_and_values(
    shape: tuple[int, ...], dtype: torch.dtype, bits: tuple[int, int] | None, device: torch.device, rotate_keys: bool, group: int | None = KV_GROUP
) -> tuple[KV, KV]:
    """Zeros for the keys and the values of slots of `shape` [..., S, D], each float in `dtype` or in
    codes of its own bits, in groups of `group` channels (kv_storage's). Keys below 8 bits are rotated when `rotate_keys`: false
    where a key bias stays in the codes (the store's), which the rotation would spread over every channel."""
    key_bits, value_bits = bits or (None, None)
    keys = allocate_kv(shape, dtype, key_bits, device, rotated=rotate_keys and key_bits is not None and key_bits < 8, group=group)
    return keys, allocate_kv(shape, dtype, value_bits, device, group=group)


def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, bits: int | None, device: torch.device, rotated: bool = False, group: int | None = KV_GROUP) -> KV:
    """Zeros for slots of `shape` [..., S, D]: float in `dtype` (no group), or `bits`-bit codes in groups of
    `group` channels (of the slots turned by a Hadamard rotation, when `rotated`)."""
    if bits is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    *slots, D = shape
    groups = D // min(group, D)
    if D % min(group, D) or D % 8 or (rotated and D & (D - 1)):
        raise UserError(
            f"a quantized KV cache needs a head dimension divisible by {group} (or by 8 below it), and a power of two for keys below 8 bits;"
            f" this model's is {D}; use --kv-dtype auto or int8"
        )
    return QuantizedKV(
        torch.zeros(*slots, D * bits // 8, dtype=torch.uint8, device=device),
        torch.zeros(*slots, groups, dtype=torch.float16, device=device),
        torch.zeros(*slots, groups, dtype=torch.float16, device=device),
        bits,
        hadamard(D, device) if rotated else None,
    )


def hadamard(n: int, device: torch.device) -> torch.Tensor:
    """The n x n Hadamard matrix scaled to be orthogonal, [n, n] float32 (n a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / math.sqrt(n)).to(device)


def quantize(x: torch.Tensor, bits: int, rotation: torch.Tensor | None = None, group: int = KV_GROUP) -> QuantizedKV:
    """x [..., D] (turned by `rotation` first, if any) -> codes and the step and minimum of each
    group of `group` channels (or of the whole of a smaller D).
    The float16 minimum is rounded down and the step up, so every value lies in the range the
    codes span: each comes back within half a step of itself (the test's bound)."""
    levels = 2**bits - 1
    x = x.float() if rotation is None else x.float() @ rotation
    groups = x.unflatten(-1, (-1, min(group, x.shape[-1])))  # [..., D / G, G]
    low, high = groups.amin(-1), groups.amax(-1)
    # float16 rounds to nearest within 2^-11 of a value (2^-25 below its normal range): push the
    # value that far out first, and the rounding cannot come back past it.
    low = (low - low.abs() * 2**-11 - 2**-24).half()
    step = (((high - low.float()) / levels) * (1 + 2**-10) + 2**-24).half()
    codes = ((groups - low.float()[..., None]) / step.float()[..., None]).round().clamp(0, levels).to(torch.uint8).flatten(-2)
    return QuantizedKV(pack_codes(codes, bits), step, low, bits, rotation)


def dequantize(q: QuantizedKV, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D * bits // 8] -> values [..., D] in `dtype`, turned back if they were rotated."""
    groups = unpack_codes(q.codes, q.bits).float().unflatten(-1, (q.step.shape[-1], -1))  # [..., D / G, G]
    x = torch.addcmul(q.low.float()[..., None], groups, q.step.float()[..., None]).flatten(-2)  # [..., D]
    return (x if q.rotation is None else x @ q.rotation.T).to(dtype)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D] uint8 below 2**bits -> [..., D * bits // 8] uint8.
    4 and 2 bits are packed in planes: with n = D * bits // 8 bytes, channel j * n + i sits in byte i
    at bit j * bits (for 4 bits, the first half of the channels in the low nibbles, the second half
    in the high ones). Unpacking then shifts every byte of a plane by the same amount, which a
    compiled step turns into vector instructions; a shift that changes from channel to channel it does not.
    3 bits are a little-endian bit string: every 8 codes fill 3 bytes, the first in the lowest bits."""
    if bits == 8:
        return codes
    if 8 % bits == 0:
        planes = codes.unflatten(-1, (8 // bits, -1)).long()  # [..., planes, n]
        shifts = torch.arange(8 // bits, device=codes.device)[:, None] * bits
        return (planes << shifts).sum(-2).to(torch.uint8)
    shifts = torch.arange(8, device=codes.device) * bits
    words = (codes.unflatten(-1, (-1, 8)).long() << shifts).sum(-1)  # [..., D / 8] of 8 * bits bits each
    return ((words[..., None] >> (torch.arange(bits, device=codes.device) * 8)) & 255).to(torch.uint8).flatten(-2)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """pack_codes undone: [..., D * bits // 8] uint8 -> codes [..., D] uint8."""
    if bits == 8:
        return packed
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)[:, None]
        return ((packed[..., None, :] >> shifts) & (2**bits - 1)).flatten(-2)  # [..., planes, n] -> [..., D]
    words = (packed.unflatten(-1, (-1, bits)).long() << (torch.arange(bits, device=packed.device) * 8)).sum(-1)  # [..., D / 8]
    return ((words[..., None] >> (torch.arange(8, device=packed.device) * bits)) & (2**bits - 1)).to(torch.uint8).flatten(-2)


def kv_map(kv: KV, fn: Callable[[torch.Tensor], torch.Tensor]) -> KV:
    """fn on a float buffer, or on each part of a quantized one."""
    return kv.map(fn) if isinstance(kv, QuantizedKV) else fn(kv)


def kv_parts(kv: KV) -> list[torch.Tensor]:
    """The tensors that hold a buffer's slots (what a compaction moves)."""
    return kv.parts if isinstance(kv, QuantizedKV) else [kv]


def kv_unbind(kv: KV) -> list[KV]:
    """A buffer of every layer [L, ...] as one per layer."""
    if isinstance(kv, QuantizedKV):
        return [QuantizedKV(*parts, kv.bits, kv.rotation) for parts in zip(*(part.unbind(0) for part in kv.parts))]
    return list(kv.unbind(0))


def kv_nbytes(kv: KV) -> int:
    return sum(part.nbytes for part in kv_parts(kv))


def kv_store(kv: KV, index: tuple, values: torch.Tensor) -> None:
    """kv[index] = values [..., D], quantized for a quantized buffer (index names leading dims only)."""
    if isinstance(kv, QuantizedKV):
        for part, new in zip(kv.parts, quantize(values, kv.bits, kv.rotation, kv.head_dim // kv.step.shape[-1]).parts):
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



def kv_storage(kv_dtype: str, model_dtype: torch.dtype) -> tuple[torch.dtype, tuple[int, int] | None, int | None]:
    """--kv-dtype as (the dtype keys and values read back in, the bits of the keys' and the
    values' codes, the channels of each group of codes (for keys per channel, also the slots of
    each key block)), None for both for floats. auto: the model's dtype, as floats."""
    if kv_dtype == "auto":
        return model_dtype, None, None
    if kv_dtype in KV_BITS:
        return model_dtype, *KV_BITS[kv_dtype]
    if kv_dtype in KV_CHANNEL_CODES:
        return model_dtype, *KV_CHANNEL_CODES[kv_dtype]
    if kv_dtype in KV_DTYPES:
        return KV_DTYPES[kv_dtype], None, None
    raise UserError(f"unknown --kv-dtype {kv_dtype!r}; choose one of auto, {', '.join([*KV_DTYPES, *KV_BITS, *KV_CHANNEL_CODES])}")


def read_keys(keys: KV, key_bias: KeyBias | None, dtype: torch.dtype) -> torch.Tensor:
    """Keys [..., H_kv, S, D] in `dtype`, their bias put back (key_bias's positions cover the same slots)."""
    if key_bias is None:
        return kv_read(keys, dtype)
    return (kv_read(keys, torch.float32) + key_bias.part(key_bias.positions)).to(dtype)


def attend_codes(q: torch.Tensor, k: KV, v: KV, key_bias: KeyBias | None, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q [B, H, T, D] over one layer's keys and values [B, H_kv, S, ...]. Rotated keys
    without a bias are read as they are stored, and q is turned the same way (qR . kR = q . k):
    one [D, D] product for the queries instead of one for every key."""
    if isinstance(k, QuantizedKV) and k.rotation is not None and key_bias is None:
        return sdpa((q.float() @ k.rotation).to(q.dtype), dequantize(k._replace(rotation=None), q.dtype), kv_read(v, q.dtype), mask)
    return sdpa(q, read_keys(k, key_bias, q.dtype), kv_read(v, q.dtype), mask)


def write_keys(keys: KV, key_bias: KeyBias | None, index: tuple, k: torch.Tensor, positions: torch.Tensor) -> None:
    """The new keys k [B, H_kv, T, D] at positions [B, T] into `index` (their slots' [B, T]), without
    their bias part, whose positions go into the same slots of key_bias's."""
    k = k.transpose(1, 2)  # [B, T, H_kv, D]
    if key_bias is not None:
        key_bias.positions[index] = positions[..., None].to(torch.int32)
        k = k - key_bias.part(positions[:, None]).transpose(1, 2)
    kv_store(keys, index, k)


class QuantizedRowsView(NamedTuple):
    """One layer of a quantized contiguous cache: codes in, floats out."""

    k: KV  # [B, H_kv, S, ...] codes
    v: KV
    key_bias: KeyBias | None = None  # this layer's
    slot_offset: torch.Tensor | None = None  # [B, 1] position - length: a new token at slot s has position slot_offset + s

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        index = (rows, slice(None), slots)  # [B, T, H_kv, D] into slots [B, T]
        write_keys(self.k, self.key_bias, index, k, None if self.slot_offset is None else self.slot_offset + slots)
        kv_store(self.v, index, v.transpose(1, 2))

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return read_keys(self.k, self.key_bias, dtype), kv_read(self.v, dtype)

    def attend(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, before_rope: torch.Tensor) -> torch.Tensor:
        return attend_codes(q, self.k, self.v, self.key_bias, mask)

    def slots_read(self) -> list[tuple[torch.Tensor, int]]:
        parts = kv_parts(self.k) + kv_parts(self.v) + ([] if self.key_bias is None else [self.key_bias.positions])
        return [(part, 2) for part in parts]  # [B, H_kv, S, ...]


@dataclass
class QuantizedKVCache(KVCache):
    """The contiguous cache with keys and values in codes (QuantizedKV), read back in `dtype`; a
    model's key bias, if it has one, is kept out of the codes (KeyBias)."""

    key_bias: KeyBias | None = None

    @classmethod
    def allocate(
        cls, config: ModelConfig, batch: int, n_slots: int, dtype: torch.dtype, device: torch.device, bits: tuple[int, int], key_bias: KeyBias | None = None,
        group: int = KV_GROUP,
    ) -> "QuantizedKVCache":
        shape = (config.n_layers, batch, config.n_kv_heads, n_slots, config.head_dim)
        keys_and_values = allocate_keys_and_values(shape, dtype, bits, device, rotate_keys=True, group=group)
        return cls(*keys_and_values, *counters(batch, device), torch.arange(n_slots, device=device), dtype, key_bias)

    def slot_shape(self) -> tuple[int, int, int, int, int]:
        return tuple(kv_shape(self.k))

    def buffers(self) -> list[torch.Tensor]:
        return kv_parts(self.k) + kv_parts(self.v) + ([] if self.key_bias is None else [self.key_bias.positions])

    def layers(self, n_slots: int | None) -> list[QuantizedRowsView]:
        k, v = self.k, self.v
        if n_slots is not None:
            k, v = (kv_map(kv, lambda t: t[:, :, :, :n_slots]) for kv in (k, v))
        if self.key_bias is None:
            return [QuantizedRowsView(*layer) for layer in zip(kv_unbind(k), kv_unbind(v))]
        offset = (self.position - self.length)[:, None]  # [B, 1]
        return [QuantizedRowsView(k_l, v_l, self.key_bias.layer(i, n_slots), offset) for i, (k_l, v_l) in enumerate(zip(kv_unbind(k), kv_unbind(v)))]

    def keys(self, layer: int, n_slots: int) -> torch.Tensor:
        key_bias = None if self.key_bias is None else self.key_bias.layer(layer, n_slots)
        return read_keys(kv_map(self.k, lambda t: t[layer, :, :, :n_slots]), key_bias, self.dtype)

    def all_keys(self) -> torch.Tensor:
        return read_keys(self.k, self.key_bias, self.dtype)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def pick(part: torch.Tensor) -> torch.Tensor:
            return part.gather(3, slots[..., None].expand(*slots.shape, part.shape[-1]))

        key_bias = None if self.key_bias is None else self.key_bias._replace(positions=self.key_bias.positions.gather(3, slots))
        return read_keys(kv_map(self.k, pick), key_bias, self.dtype), kv_read(kv_map(self.v, pick), self.dtype)

    def row(self, b: int) -> "QuantizedKVCache":
        rows = slice(b, b + 1)
        k, v = (kv_map(kv, lambda t: t[:, rows]) for kv in (self.k, self.v))
        key_bias = None if self.key_bias is None else self.key_bias._replace(positions=self.key_bias.positions[:, rows])
        return replace(self, k=k, v=v, length=self.length[rows], position=self.position[rows], prompt_length=self.prompt_length[rows], key_bias=key_bias)
