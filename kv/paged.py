"""The paged KV cache: one pool of fixed-size blocks for every row, and a block table per row.

Slot s of row b lives in block `block_table[b, s // block_size]` at offset `s % block_size`.
The pool and the table are allocated once, before decoding, and keep their shapes; between
steps the host hands a row a free block when its next slot starts one, and takes back the
blocks a row no longer needs: all of them when it finishes, the ones past its length after a
compaction. So a row holds what it uses, not what the longest row might, and memory a KV policy
evicts is memory another row can take.

Block 0 is scratch, never handed out: every table entry a row does not own points to it, so
an idle row of a continuous batch (which still runs through the fixed-shape step) writes there.
Slots and positions work as in the contiguous cache (kv/cache.py).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from errors import UserError
from kv import flash
from kv.cache import counters
from kv.compaction import BITS, compact_in_place, compaction_moves
from kv.key_bias import KeyBias
from kv.prefix_cache import PrefixCache
from kv.quantized import KV, KV_GROUP, QuantizedKV, allocate_keys_and_values, attend_codes, kv_map, kv_parts, kv_read, kv_shape, kv_store, kv_unbind, read_keys, write_keys
from models.config import ModelConfig

SCRATCH_BLOCK = 0


class Pages(NamedTuple):
    """A paged cache as one forward pass reads it."""

    table: torch.Tensor  # [B, max_blocks] the pool block of each row's slots s // block_size
    blocks: torch.Tensor  # [B, 1, S] the pool block of each slot read
    heads: torch.Tensor  # [1, H_kv, 1]
    offsets: torch.Tensor  # [B, 1, S] its offset in the block


def page_address(block_table: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool block and the offset in it of each slot [B, ...] of each row: two [B, ...] tensors."""
    blocks = block_table.gather(1, (slots // block_size).flatten(1)).view(slots.shape)
    return blocks, slots % block_size


def read_pages(block_table: torch.Tensor, n_slots: int, n_kv_heads: int, block_size: int) -> Pages:
    """Where the first n_slots slots of every row lie in the pool."""
    slots = torch.arange(n_slots, device=block_table.device).expand(block_table.shape[0], n_slots)  # [B, S]
    blocks, offsets = page_address(block_table, slots, block_size)
    return Pages(block_table, blocks[:, None], torch.arange(n_kv_heads, device=block_table.device)[None, :, None], offsets[:, None])


def gather_pages(pool: torch.Tensor, pages: Pages) -> torch.Tensor:
    """The slots `pages` reads, [..., B, H_kv, S, D], from a pool [..., n_blocks, H_kv, block_size, D]
    (one layer's, or every layer's)."""
    return pool[..., pages.blocks, pages.heads, pages.offsets, :]


def paged_key_bias(key_bias: KeyBias | None, pages: Pages) -> KeyBias | None:
    """key_bias (its positions a pool [..., n_blocks, H_kv, block_size]) over the slots `pages` reads."""
    if key_bias is None:
        return None
    return key_bias._replace(positions=key_bias.positions[..., pages.blocks, pages.heads, pages.offsets])


class PagedView(NamedTuple):
    """One layer of the paged cache: row b's slot s lies in block pages.table[b, s // block]."""

    k: KV  # [n_blocks, H_kv, block, D] the layer's pool
    v: KV  # [n_blocks, H_kv, block, D]
    pages: Pages  # the block table, and where the slots read lie (worked out once per forward)
    key_bias: KeyBias | None = None  # this layer's, its positions a pool [n_blocks, H_kv, block] (kv/key_bias.py)
    slot_offset: torch.Tensor | None = None  # [B, 1] position - length: a new token at slot s has position slot_offset + s

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        blocks, offsets = page_address(self.pages.table, slots, kv_parts(self.k)[0].shape[2])  # [B, T] each
        index = (blocks, slice(None), offsets)  # [B, T, H_kv, D] into their blocks
        write_keys(self.k, self.key_bias, index, k, None if self.slot_offset is None else self.slot_offset + slots)
        kv_store(self.v, index, v.transpose(1, 2))

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's first S slots gathered from the pool, [B, H_kv, S, D] each."""
        k, v = self.gathered()
        return read_keys(k, paged_key_bias(self.key_bias, self.pages), dtype), kv_read(v, dtype)

    def gathered(self) -> tuple[KV, KV]:
        """Each row's first S slots from the pool, as stored, [B, H_kv, S, ...] each."""
        return tuple(kv_map(kv, lambda pool: gather_pages(pool, self.pages)) for kv in (self.k, self.v))

    def attend(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, before_rope: torch.Tensor) -> torch.Tensor:
        """flash-attn reads a decode step's slots in use through the block table itself, where it
        can (kv/flash.py); otherwise SDPA runs over the gathered slots."""
        if q.shape[2] == 1 and not isinstance(self.k, QuantizedKV):
            if flash.why_not_flash(q.device, q.dtype, self.k.dtype, q.shape[-1], self.k.shape[2], False) is None:
                return flash.flash_decode(q, self.k, self.v, slots[:, 0] + 1, self.pages.table)
        return attend_codes(q, *self.gathered(), paged_key_bias(self.key_bias, self.pages), mask)

    def slots_read(self) -> list[tuple[torch.Tensor, int]]:
        return [(self.pages.blocks, 2), (self.pages.offsets, 2)]  # [B, 1, S] each


def default_block_size(device: torch.device) -> int:
    """16 slots; on CUDA with flash-attn, the page size it reads through a block table."""
    return flash.FLASH_PAGE_MULTIPLE if device.type == "cuda" and flash.kernel is not None else 16


@dataclass(frozen=True)
class PageConfig:
    block_size: int = 16  # slots per block, a power of two (flash-attn reads pages of multiples of 256)
    n_blocks: int | None = None  # the pool; None: enough for every row's whole table

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise UserError(f"the block size must be a power of two, got {self.block_size}")
        if self.n_blocks is not None and self.n_blocks < 1:
            raise UserError(f"the paged cache needs at least one block, got {self.n_blocks}")


@dataclass
class BlockManager:
    """The host's account of the pool: which blocks are free, which each row holds (in slot order),
    and how many rows hold each block. A block goes back to the free list when its last holder
    lets it go, so that rows may share blocks (a common prefix)."""

    free: list[int]  # the blocks no row holds, handed out from the end (a prefix cache's parked ones aside)
    rows: list[list[int]]  # each row's blocks, in slot order
    holders: list[int]  # [pool blocks] how many rows hold each block (the scratch block: none)
    peak: int = 0  # the most blocks held at once
    prefix: PrefixCache | None = None  # the full blocks of prompts, findable again (kv/prefix_cache.py)

    @classmethod
    def of(cls, n_blocks: int, batch: int) -> "BlockManager":
        """n_blocks blocks for `batch` rows, numbered from 1 (block 0 is scratch)."""
        return cls(list(range(n_blocks, 0, -1)), [[] for _ in range(batch)], [0] * (n_blocks + 1))

    @property
    def n_free(self) -> int:
        """The blocks a row may take: the free ones and those a prefix cache keeps parked."""
        return len(self.free) + (0 if self.prefix is None else len(self.prefix.parked))

    @property
    def in_use(self) -> int:
        return len(self.holders) - 1 - self.n_free

    def take(self, row: int) -> int:
        """A free block (else the least recently used parked one), appended to the row's."""
        block = self.free.pop() if self.free else self.prefix.evict()
        self.adopt(row, block)
        return block

    def adopt(self, row: int, block: int) -> None:
        """The row holds the block too (a free one, or a cached prefix's), after its others."""
        if self.holders[block] == 0 and self.prefix is not None:
            self.prefix.unpark(block)
        self.rows[row].append(block)
        self.holders[block] += 1
        self.peak = max(self.peak, self.in_use)

    def keep(self, row: int, n_blocks: int) -> None:
        """The row lets go of its blocks past its first n_blocks."""
        for block in reversed(self.rows[row][n_blocks:]):
            self.holders[block] -= 1
            if self.holders[block] == 0 and (self.prefix is None or not self.prefix.park(block)):
                self.free.append(block)
        del self.rows[row][n_blocks:]

    def row(self, b: int) -> "BlockManager":
        """Row b alone, over the same free list and counts."""
        return replace(self, rows=[self.rows[b]])


@dataclass
class PagedKVCache:
    k: KV  # [L, n_blocks, H_kv, block_size, D] keys after RoPE, every row's blocks (quantized: kv/quantized.py)
    v: KV  # [L, n_blocks, H_kv, block_size, D]
    block_table: torch.Tensor  # [B, max_blocks] int64 pool block of each row's slots s // block_size
    length: torch.Tensor  # [B] int64 slots in use
    position: torch.Tensor  # [B] int64 absolute position of the next token
    prompt_length: torch.Tensor  # [B] int64 slots holding the prompt (the protected prefix)
    slot_ids: torch.Tensor  # [S] 0..S-1, S the slots a row may hold (its table's blocks hold up to a block more)
    dtype: torch.dtype  # what the keys and values read back as: the buffers' own, or a quantized cache's model dtype
    blocks: BlockManager  # host: which blocks each row holds, and which are free
    key_bias: KeyBias | None = None  # quantized keys of a key-biased model: the bias kept out of the codes, positions [L, n_blocks, H_kv, block_size]

    @classmethod
    def allocate(
        cls, config: ModelConfig, batch: int, n_slots: int, dtype: torch.dtype, device: torch.device,
        pages: PageConfig = PageConfig(), *, bits: tuple[int, int] | None = None, group: int | None = KV_GROUP, key_bias: Callable[[tuple[int, ...]], KeyBias | None] | None = None,
    ) -> "PagedKVCache":
        """Rows of up to n_slots slots (tables of n_slots / block_size blocks, rounded up); a pool of
        pages.n_blocks blocks (default: enough for every row's whole table, about the contiguous
        cache's memory) plus the scratch block. Buffers of `dtype`, or with `bits` (the keys' and the values') quantized ones, in groups of `group` channels, read back in it.
        key_bias: makes the KeyBias of a pool of this slot layout (kv.key_bias.model_key_bias), for quantized keys."""
        block_size = pages.block_size
        max_blocks = -(-n_slots // block_size)
        n_blocks = batch * max_blocks if pages.n_blocks is None else pages.n_blocks
        shape = (config.n_layers, n_blocks + 1, config.n_kv_heads, block_size, config.head_dim)
        bias = key_bias(shape[1:-1]) if key_bias is not None and bits is not None else None
        return cls(
            *allocate_keys_and_values(shape, dtype, bits, device, rotate_keys=bias is not None or not config.qkv_bias, group=group),
            torch.full((batch, max_blocks), SCRATCH_BLOCK, dtype=torch.int64, device=device),
            *counters(batch, device),
            torch.arange(n_slots, device=device),
            dtype,
            BlockManager.of(n_blocks, batch),
            bias,
        )

    @property
    def block_size(self) -> int:
        return kv_shape(self.k)[3]

    @property
    def pool_blocks(self) -> int:
        """The blocks of the pool, the scratch block included."""
        return kv_shape(self.k)[1]

    @property
    def device(self) -> torch.device:
        return self.slot_ids.device

    def slot_shape(self) -> tuple[int, int, int, int, int]:
        """(L, B, H_kv, S, D): the slots of every layer and row, as the contiguous cache holds them."""
        L, _, H_kv, _, D = kv_shape(self.k)
        return L, self.length.shape[0], H_kv, self.n_slots, D

    @property
    def n_slots(self) -> int:
        """The most slots one row can hold; the whole-cache read covers exactly these, as the
        contiguous cache's does, so that both attend over the same shape."""
        return self.slot_ids.shape[0]

    def pools(self) -> list[torch.Tensor]:
        """Every tensor indexed by pool slot, [L, n_blocks, H_kv, block_size, ...]: codes, scales and positions."""
        return kv_parts(self.k) + kv_parts(self.v) + ([] if self.key_bias is None else [self.key_bias.positions])

    @property
    def nbytes(self) -> int:
        """The pool's K and V with their scales (and positions)."""
        return sum(pool.nbytes for pool in self.pools())

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block, over every layer."""
        return self.nbytes // self.pool_blocks

    @property
    def peak_bytes(self) -> int:
        """K and V bytes of the most blocks held at once."""
        return self.blocks.peak * self.block_bytes

    def layers(self, n_slots: int | None) -> list[PagedView]:
        """Each layer's pool, with where the first n_slots slots of every row lie (None: all
        n_slots of them), for a forward pass. The table is the whole one for every n_slots, so a
        compiled step does not specialise on it."""
        pages = self._pages(self.n_slots if n_slots is None else n_slots)
        if self.key_bias is None:
            return [PagedView(k, v, pages) for k, v in zip(kv_unbind(self.k), kv_unbind(self.v))]
        offset = (self.position - self.length)[:, None]  # [B, 1]
        return [PagedView(k, v, pages, self.key_bias.layer(i, None), offset) for i, (k, v) in enumerate(zip(kv_unbind(self.k), kv_unbind(self.v)))]

    def keys(self, layer: int, n_slots: int) -> torch.Tensor:
        """One layer's keys of the first n_slots slots of every row, [B, H_kv, n_slots, D]."""
        pages = self._pages(n_slots)
        key_bias = None if self.key_bias is None else paged_key_bias(self.key_bias.layer(layer, None), pages)
        return read_keys(kv_map(self.k, lambda pool: gather_pages(pool[layer], pages)), key_bias, self.dtype)

    def all_keys(self) -> torch.Tensor:
        """Every layer's keys of every slot, [L, B, H_kv, S, D]."""
        pages = self._pages(self.n_slots)
        key_bias = paged_key_bias(self.key_bias, pages)
        return read_keys(kv_map(self.k, lambda pool: gather_pages(pool, pages)), key_bias, self.dtype)

    def _pages(self, n_slots: int) -> Pages:
        """Where the first n_slots slots of every row lie in the pool."""
        return read_pages(self.block_table, n_slots, kv_shape(self.k)[2], self.block_size)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the slots [L, B, H_kv, E], [L, B, H_kv, E, D] each."""
        heads = torch.arange(slots.shape[2], device=slots.device)[None, :, None]  # [1, H_kv, 1]
        addresses = [page_address(self.block_table, layer_slots, self.block_size) for layer_slots in slots]  # [B, H_kv, E] each

        def gather(pool: torch.Tensor) -> torch.Tensor:
            return torch.stack([pool[layer][blocks, heads, offsets] for layer, (blocks, offsets) in enumerate(addresses)])

        key_bias = None if self.key_bias is None else self.key_bias._replace(positions=gather(self.key_bias.positions))
        return read_keys(kv_map(self.k, gather), key_bias, self.dtype), kv_read(kv_map(self.v, gather), self.dtype)

    def compact(self, buffers: list[torch.Tensor], prompt_length: torch.Tensor, keep: torch.Tensor, n_candidates: int, window: int) -> None:
        """Compact each row into the front of its own blocks, and the caller's per-slot buffers
        [L, B, H_kv, S, ...] as compact_in_place does; the blocks left empty are for `fit` to return."""
        source, target = compaction_moves(prompt_length, keep, n_candidates, window)
        for pool in self.pools():
            self._move_slots(pool, source, target)
        compact_in_place(buffers, prompt_length, keep, n_candidates, window)

    def _move_slots(self, pool: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
        """Slot source -> slot target [L, B, H_kv, N] of each (layer, row, KV head) in a pool,
        moving the values' bits as integers (kv.compaction.scatter_bits_). A layer's
        sources are all read before any is written, as in compact_in_place."""
        bits = pool.view(BITS[pool.element_size()])
        heads = torch.arange(pool.shape[2], device=pool.device)[None, :, None]  # [1, H_kv, 1]
        for layer in range(pool.shape[0]):
            blocks, offsets = page_address(self.block_table, source[layer], self.block_size)  # [B, H_kv, N] each
            moved = bits[layer][blocks, heads, offsets]  # [B, H_kv, N, ...]
            blocks, offsets = page_address(self.block_table, target[layer], self.block_size)
            bits[layer][blocks, heads, offsets] = moved

    def row(self, b: int) -> "PagedKVCache":
        """Row b alone, as a cache of one row over the same pool: views of its table and counters.
        Blocks are handed out and taken back through the whole cache (fit, release)."""
        rows = slice(b, b + 1)
        return replace(
            self, block_table=self.block_table[rows], length=self.length[rows], position=self.position[rows],
            prompt_length=self.prompt_length[rows], blocks=self.blocks.row(b),
        )

    def fit(self, row: int, n_slots: int) -> None:
        """Give the row blocks until its table covers n_slots slots, or return those past them."""
        if n_slots > self.n_slots:
            raise UserError(f"a row needs {n_slots} slots but the paged cache's rows hold {self.n_slots}; allocate the cache for longer rows")
        held = self.blocks.rows[row]
        while len(held) * self.block_size < n_slots:
            if not self.blocks.n_free:
                raise UserError(
                    f"the paged cache's {self.pool_blocks - 1} blocks are all in use (a row needs {n_slots} slots); "
                    "give the pool more blocks or run fewer rows at once"
                )
            index = len(held)
            self.block_table[row, index] = self.blocks.take(row)
        keep = -(-n_slots // self.block_size)
        if keep < len(held):
            self.block_table[row, keep : len(held)] = SCRATCH_BLOCK
            self.blocks.keep(row, keep)

    def share_prefix(self, row: int, prompt: list[int]) -> int:
        """Into an empty row: the cached blocks its prompt begins with, if any (a prefix cache's);
        returns the slots they fill, which the row's counters now count."""
        found = [] if self.blocks.prefix is None else self.blocks.prefix.lookup(prompt)
        for index, block in enumerate(found):
            self.blocks.adopt(row, block)
            self.block_table[row, index] = block
        cached = len(found) * self.block_size
        self.length[row] = self.position[row] = cached
        return cached

    def register_prefix(self, row: int, tokens: list[int]) -> None:
        """The row's slots hold these tokens from slot 0: its full blocks become findable by later prompts."""
        if self.blocks.prefix is not None:
            self.blocks.prefix.register(tokens, self.blocks.rows[row])

    def release(self, row: int) -> None:
        """Return all of the row's blocks and empty it."""
        self.fit(row, 0)
        for counter in (self.length, self.position, self.prompt_length):
            counter[row] = 0
