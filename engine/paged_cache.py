"""The paged KV cache: one pool of fixed-size blocks for every row, and a block table per row.

Slot s of row b lives in block `block_table[b, s // block_size]` at offset `s % block_size`.
The pool and the table are allocated once, before decoding, and keep their shapes; between
steps the host hands a row a free block when its next slot starts one, and takes back the
blocks a row no longer needs: all of them when it finishes, the ones past its length after a
compaction. So a row holds what it uses, not what the longest row might, and memory a KV policy
evicts is memory another row can take.

Block 0 is scratch, never handed out: every table entry a row does not own points to it, so
an idle row of a continuous batch (which still runs through the fixed-shape step) writes there.
Slots and positions work as in the contiguous cache (engine/kv_cache.py).
"""

from dataclasses import dataclass, replace

import torch

from compression.compaction import BITS, compact_in_place, compaction_moves
from engine.kv_store import KVStore
from errors import UserError
from models import flash_attention
from models.config import ModelConfig
from models.kv_layers import PagedLayer
from models.kv_quant import KV, allocate_keys_and_values, kv_map, kv_nbytes, kv_parts, kv_read, kv_shape, kv_unbind
from models.pages import Pages, gather_pages, page_address, read_pages

SCRATCH_BLOCK = 0


def default_block_size(device: torch.device) -> int:
    """16 slots; on CUDA with flash-attn, the page size it reads through a block table."""
    return flash_attention.FLASH_PAGE_MULTIPLE if device.type == "cuda" and flash_attention.kernel is not None else 16


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
class PagedKVCache:
    k: KV  # [L, n_blocks, H_kv, block_size, D] keys after RoPE, every row's blocks (quantized: models/kv_quant.py)
    v: KV  # [L, n_blocks, H_kv, block_size, D]
    block_table: torch.Tensor  # [B, max_blocks] int64 pool block of each row's slots s // block_size
    length: torch.Tensor  # [B] int64 slots in use
    position: torch.Tensor  # [B] int64 absolute position of the next token
    prompt_length: torch.Tensor  # [B] int64 slots holding the prompt (the protected prefix)
    slot_ids: torch.Tensor  # [S] 0..S-1, S the slots a row may hold (its table's blocks hold up to a block more)
    dtype: torch.dtype  # what the keys and values read back as: the buffers' own, or a quantized cache's model dtype
    free: list[int]  # host: the blocks no row holds, handed out from the end
    rows: list[list[int]]  # host: each row's blocks, in slot order
    peak_blocks: int = 0  # host: the most blocks held at once
    store: KVStore | None = None  # where compactions demote what they evict (engine/kv_store.py)

    @classmethod
    def allocate(
        cls, config: ModelConfig, batch: int, n_slots: int, dtype: torch.dtype, device: torch.device,
        pages: PageConfig = PageConfig(), *, bits: tuple[int, int] | None = None,
    ) -> "PagedKVCache":
        """Rows of up to n_slots slots (tables of n_slots / block_size blocks, rounded up); a pool of
        pages.n_blocks blocks (default: enough for every row's whole table, about the contiguous
        cache's memory) plus the scratch block. Buffers of `dtype`, or with `bits` (the keys' and the values') quantized ones read back in it."""
        block_size = pages.block_size
        max_blocks = -(-n_slots // block_size)
        n_blocks = batch * max_blocks if pages.n_blocks is None else pages.n_blocks
        shape = (config.n_layers, n_blocks + 1, config.n_kv_heads, block_size, config.head_dim)
        counters = [torch.zeros(batch, dtype=torch.int64, device=device) for _ in range(3)]
        return cls(
            *allocate_keys_and_values(shape, dtype, bits, device),
            torch.full((batch, max_blocks), SCRATCH_BLOCK, dtype=torch.int64, device=device),
            *counters,
            torch.arange(n_slots, device=device),
            dtype,
            list(range(n_blocks, 0, -1)),
            [[] for _ in range(batch)],
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

    @property
    def nbytes(self) -> int:
        """The pool's K and V with their scales, and the store's bytes."""
        return kv_nbytes(self.k) + kv_nbytes(self.v) + (0 if self.store is None else self.store.nbytes)

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block, over every layer."""
        return (kv_nbytes(self.k) + kv_nbytes(self.v)) // self.pool_blocks

    @property
    def blocks_in_use(self) -> int:
        return self.pool_blocks - 1 - len(self.free)

    @property
    def peak_bytes(self) -> int:
        """K and V bytes of the most blocks held at once, and the store's."""
        return self.peak_blocks * self.block_bytes + (0 if self.store is None else self.store.nbytes)

    def layers(self, n_slots: int | None) -> list[PagedLayer]:
        """Each layer's pool, with where the first n_slots slots of every row lie (None: all
        n_slots of them), for a forward pass. The table is the whole one for every n_slots, so a
        compiled step does not specialise on it."""
        pages = self._pages(self.n_slots if n_slots is None else n_slots)
        stores = [None] * self.slot_shape()[0] if self.store is None else self.store.layers()
        return [PagedLayer(k, v, pages, store) for k, v, store in zip(kv_unbind(self.k), kv_unbind(self.v), stores)]

    def keys(self, layer: int, n_slots: int) -> torch.Tensor:
        """One layer's keys of the first n_slots slots of every row, [B, H_kv, n_slots, D]."""
        pages = self._pages(n_slots)
        return kv_read(kv_map(self.k, lambda pool: gather_pages(pool[layer], pages)), self.dtype)

    def all_keys(self) -> torch.Tensor:
        """Every layer's keys of every slot, [L, B, H_kv, S, D]."""
        pages = self._pages(self.n_slots)
        return kv_read(kv_map(self.k, lambda pool: gather_pages(pool, pages)), self.dtype)

    def _pages(self, n_slots: int) -> Pages:
        """Where the first n_slots slots of every row lie in the pool."""
        return read_pages(self.block_table, n_slots, kv_shape(self.k)[2], self.block_size)

    def demote(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy the slots [L, B, H_kv, E] about to be evicted, and the positions they hold, into the store."""
        heads = torch.arange(slots.shape[2], device=slots.device)[None, :, None]  # [1, H_kv, 1]
        addresses = [page_address(self.block_table, layer_slots, self.block_size) for layer_slots in slots]  # [B, H_kv, E] each

        def gather(pool: torch.Tensor) -> torch.Tensor:
            return torch.stack([pool[layer][blocks, heads, offsets] for layer, (blocks, offsets) in enumerate(addresses)])

        k, v = (kv_read(kv_map(kv, gather), self.dtype) for kv in (self.k, self.v))
        self.store.demote(k, v, positions)

    def compact(self, buffers: list[torch.Tensor], prompt_length: torch.Tensor, keep: torch.Tensor, n_candidates: int, window: int) -> None:
        """Compact each row into the front of its own blocks, and the caller's per-slot buffers
        [L, B, H_kv, S, ...] as compact_in_place does; the blocks left empty are for `shrink` to return."""
        source, target = compaction_moves(prompt_length, keep, n_candidates, window)
        for pool in kv_parts(self.k) + kv_parts(self.v):
            self._move_slots(pool, source, target)
        compact_in_place(buffers, prompt_length, keep, n_candidates, window)

    def _move_slots(self, pool: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
        """Slot source -> slot target [L, B, H_kv, N] of each (layer, row, KV head) in a pool,
        moving the values' bits as integers (compression.compaction.scatter_bits_). A layer's
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
        Blocks are handed out and taken back through the whole cache (reserve, shrink, release)."""
        rows = slice(b, b + 1)
        return replace(
            self, block_table=self.block_table[rows], length=self.length[rows], position=self.position[rows],
            prompt_length=self.prompt_length[rows], rows=[self.rows[b]], store=None if self.store is None else self.store.row(b),
        )

    def reserve(self, row: int, n_slots: int) -> None:
        """Give the row blocks until its table covers n_slots slots."""
        if n_slots > self.n_slots:
            raise UserError(f"a row needs {n_slots} slots but the paged cache's rows hold {self.n_slots}; allocate the cache for longer rows")
        blocks = self.rows[row]
        while len(blocks) * self.block_size < n_slots:
            if not self.free:
                raise UserError(
                    f"the paged cache's {self.pool_blocks - 1} blocks are all in use (a row needs {n_slots} slots); "
                    "give the pool more blocks or run fewer rows at once"
                )
            self.block_table[row, len(blocks)] = self.free[-1]
            blocks.append(self.free.pop())
            self.peak_blocks = max(self.peak_blocks, self.blocks_in_use)

    def shrink(self, row: int, n_slots: int) -> None:
        """Return the row's blocks past its first n_slots slots to the pool."""
        blocks = self.rows[row]
        keep = -(-n_slots // self.block_size)
        if keep < len(blocks):
            self.block_table[row, keep : len(blocks)] = SCRATCH_BLOCK
            self.free.extend(reversed(blocks[keep:]))
            del blocks[keep:]

    def release(self, row: int) -> None:
        """Return all of the row's blocks and empty it."""
        self.shrink(row, 0)
        for counter in (self.length, self.position, self.prompt_length):
            counter[row] = 0
