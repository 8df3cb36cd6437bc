"""A KV cache whose keys are in codes per channel over blocks of slots (KIVI's layout for keys),
its values in codes per slot as in kv/quantized.py. `--kv-dtype kcNvM`: keys in N bits, values in M.

A key's channels differ in range far more than its slots do: a few channels are large in every slot
(Qwen2's key bias among them). A per-slot group has to span those channels; a step and a minimum
per channel over a block of slots follow each channel's own range, so that keys keep at 3 bits what
per-slot groups keep at 4 (docs/quantization.md). A block holds 32 slots and a group of values 32
channels; `kcNvMg64` makes both 64, half a bit less per element on each. Each (layer, row, KV head)
splits its slots into blocks. A write quantizes again every block it touches: the block of the
row's last slot is kept in floats as well (`tail`), and each block is quantized from floats over
the slots it holds so far. So every read is of codes, a block's range is that of what it holds, and
a key is rounded once.

A prefill of rows of different lengths writes each row's padding after its real slots. If the
padding ran into a later block, the tail holds that block, so the row's next write takes its own
last block back from the codes: those keys are rounded a second time, within half a step of the
old block and half of the new one.

A compaction would move slots between blocks, whose steps and minima belong to the slots they
held, so every kept key would be rounded again at each compaction (docs/quantization.md measures
the drift). This cache keeps every slot: a KV policy, the paged cache and speculative decoding
refuse it (engine/options.py).
"""

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from errors import UserError
from kv.cache import KVCache, counters, sdpa
from kv.quantized import KV, QuantizedKV, allocate_kv, dequantize, kv_map, kv_parts, kv_read, kv_shape, kv_store, kv_unbind, quantize
from models.config import ModelConfig


class ChannelKeys(NamedTuple):
    """Keys in codes per channel over blocks of `block` slots. One spare block past the last follows,
    so that a write may quantize every block it could reach without knowing where it ends."""

    codes: torch.Tensor  # [..., NB, D, block * bits // 8] uint8: each channel's codes, slot by slot
    step: torch.Tensor  # [..., NB, D, 1] float16
    low: torch.Tensor  # [..., NB, D, 1] float16, at or below each channel's values in the block
    tail: torch.Tensor  # [..., block, D] the floats of the block of the last slot written
    tail_block: torch.Tensor  # [...] int64: which block the tail is
    bits: int

    def map(self, fn) -> "ChannelKeys":
        return ChannelKeys(*(fn(part) for part in self.parts), self.bits)

    @property
    def parts(self) -> list[torch.Tensor]:
        return [self.codes, self.step, self.low, self.tail, self.tail_block]

    @property
    def block(self) -> int:  # the slots whose keys share each channel's step and minimum
        return self.tail.shape[-2]

    def blocks(self) -> QuantizedKV:
        return QuantizedKV(self.codes, self.step, self.low, self.bits)

    def read(self, n_slots: int, dtype: torch.dtype) -> torch.Tensor:
        """The first n_slots keys [..., n_slots, D] in `dtype`. Every block is dequantized: a count
        of blocks that follows n_slots would be one more size for a compiled step to guard on."""
        return dequantize(self.blocks(), dtype).transpose(-1, -2).flatten(-3, -2)[..., :n_slots, :]  # [..., NB, D, block] -> [..., S, D]

    def write(self, k: torch.Tensor, slots: torch.Tensor) -> None:
        """The keys k [B, H_kv, T, D] into the slots [B, T] (consecutive in each row, from the
        row's length), every block they touch quantized again with the slots it holds."""
        B, H, T, D = k.shape
        G = self.block  # slots per block
        n = (2 * G - 2 + T) // G  # the most blocks T consecutive slots can touch
        first = slots[:, 0] // G  # [B] the block the write starts in
        rows = torch.arange(B, device=k.device)[:, None]  # [B, 1]
        in_codes = dequantize(self.blocks().map(lambda t: t[rows[:, 0], :, first]), torch.float32).transpose(-1, -2)  # [B, H_kv, G, D]
        kept = (self.tail_block == first[:, None])[..., None, None]  # [B, H_kv, 1, 1]: the tail is this block (not a padded prefill's later one)
        work = torch.zeros(B, H, n * G, D, dtype=torch.float32, device=k.device)
        work[:, :, :G] = torch.where(kept, self.tail.float(), in_codes)  # the first block's slots written before
        work[rows, :, slots - first[:, None] * G] = k.transpose(1, 2).float()  # [B, T, H_kv, D] into [B, T]
        held = torch.arange(n * G, device=k.device) < (slots[:, -1:] + 1 - first[:, None] * G)  # [B, n * G]
        blocks = work.unflatten(2, (n, G))  # [B, H_kv, n, G, D]
        # A slot not held takes the value of its block's first slot, so the block's range is that of what it holds.
        blocks = torch.where(held.view(B, 1, n, G, 1), blocks, blocks[:, :, :, :1])
        new = quantize(blocks.transpose(-1, -2), self.bits, group=G)  # per channel: codes [B, H_kv, n, D, G * bits // 8]
        ids = first[:, None] + torch.arange(n, device=k.device)  # [B, n]
        for part, value in zip((self.codes, self.step, self.low), new.parts):
            part[rows, :, ids] = value.transpose(1, 2)  # [B, n, H_kv, D, ...] into [B, n]
        last = slots[:, -1] // G - first  # [B] the block of each row's last slot, counted from first
        self.tail.copy_(blocks[rows[:, 0], :, last])
        self.tail_block.copy_((first + last)[:, None].expand_as(self.tail_block))


def allocate_channel_keys(shape: tuple[int, ...], dtype: torch.dtype, bits: int, device: torch.device, block: int) -> ChannelKeys:
    """Zeros for the keys of slots of `shape` [..., S, D], in blocks of `block` slots and one spare."""
    *lead, S, D = shape
    n_blocks = -(-S // block) + 1
    blocks = (*lead, n_blocks, D)
    return ChannelKeys(
        torch.zeros(*blocks, block * bits // 8, dtype=torch.uint8, device=device),
        torch.zeros(*blocks, 1, dtype=torch.float16, device=device),
        torch.zeros(*blocks, 1, dtype=torch.float16, device=device),
        torch.zeros(*lead, block, D, dtype=dtype, device=device),
        torch.zeros(*lead, dtype=torch.int64, device=device),
        bits,
    )


class ChannelKeysView(NamedTuple):
    """One layer of a ChannelKeysKVCache: every block of keys, and the values of the slots viewed."""

    k: ChannelKeys  # [B, H_kv, ...]
    v: KV  # [B, H_kv, S, ...] codes per slot: S, the slots viewed

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.k.write(k, slots)
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        kv_store(self.v, (rows, slice(None), slots), v.transpose(1, 2))

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.read(kv_shape(self.v)[2], dtype), kv_read(self.v, dtype)

    def attend(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, before_rope: torch.Tensor) -> torch.Tensor:
        return sdpa(q, *self.read(q.dtype), mask)

    def slots_read(self) -> list[tuple[torch.Tensor, int]]:
        return [(part, 2) for part in kv_parts(self.v)]  # [B, H_kv, S, ...]; the keys' blocks are read whole


@dataclass
class ChannelKeysKVCache(KVCache):
    """The contiguous cache with keys in codes per channel over blocks (ChannelKeys) and values
    in codes per slot, read back in `dtype`. It holds every slot: it is never compacted."""

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, n_slots: int, dtype: torch.dtype, device: torch.device, bits: tuple[int, int], group: int) -> "ChannelKeysKVCache":
        """`group`: the slots of each key block, and the channels of each value group."""
        if config.head_dim % 8:
            raise UserError(f"--kv-dtype kcNvM needs a head dimension divisible by 8; this model's is {config.head_dim}; use --kv-dtype auto or int8")
        shape = (config.n_layers, batch, config.n_kv_heads, n_slots, config.head_dim)
        keys = allocate_channel_keys(shape, dtype, bits[0], device, group)
        return cls(keys, allocate_kv(shape, dtype, bits[1], device, group=group), *counters(batch, device), torch.arange(n_slots, device=device), dtype)

    def slot_shape(self) -> tuple[int, int, int, int, int]:
        return tuple(kv_shape(self.v))

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (its bytes); the keys' blocks are not indexed by slot, and nothing compacts them."""
        return self.k.parts + kv_parts(self.v)

    def layers(self, n_slots: int | None) -> list[ChannelKeysView]:
        n = self.n_slots if n_slots is None else n_slots
        v = kv_map(self.v, lambda t: t[:, :, :, :n])
        keys = [ChannelKeys(*parts, self.k.bits) for parts in zip(*(part.unbind(0) for part in self.k.parts))]
        return [ChannelKeysView(k, v_l) for k, v_l in zip(keys, kv_unbind(v))]

    def keys(self, layer: int, n_slots: int) -> torch.Tensor:
        return self.k.map(lambda t: t[layer]).read(n_slots, self.dtype)

    def all_keys(self) -> torch.Tensor:
        return self.k.read(self.n_slots, self.dtype)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = slots[..., None].expand(*slots.shape, self.k.tail.shape[-1])  # [L, B, H_kv, E, D]
        return self.all_keys().gather(3, index), kv_read(self.v, self.dtype).gather(3, index)

    def compact(self, buffers: list[torch.Tensor], prompt_length: torch.Tensor, keep: torch.Tensor, n_candidates: int, window: int) -> None:
        raise UserError("a cache with keys per channel (--kv-dtype kcNvM) keeps every slot; a KV policy needs per-slot codes, e.g. --kv-dtype int3")

    def row(self, b: int) -> "ChannelKeysKVCache":
        rows = slice(b, b + 1)
        k, v = self.k.map(lambda t: t[:, rows]), kv_map(self.v, lambda t: t[:, rows])
        return replace(self, k=k, v=v, length=self.length[rows], position=self.position[rows], prompt_length=self.prompt_length[rows])
