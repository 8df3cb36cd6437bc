"""Prefix caching for the paged cache: the full blocks of a prompt found again by a chained hash,
and shared by the rows whose prompts begin alike.

A block's hash is sha256 of its parent's hash and its tokens; the chain starts from a salt of
what else decides a block's keys and values (the model, the KV storage). Equal hashes mean equal
tokens from the first slot to the block's end, hence the same keys and values, so a row whose
prompt begins with cached blocks takes them into its table and prefills only the rest.

A shared block is never written: a row writes at its length and beyond, and only full blocks of
a prompt are shared. The last prompt token is always computed, so a prompt that is all cached
blocks still prefills its last token (its logits give the first answer token).

A block no row holds keeps its content and its hash while the pool has other free blocks: it is
parked, least recently used first, and taken back (its hash forgotten) only when nothing else is
free. Compaction moves slots, so rows under a KV policy neither share nor register blocks.
"""

import hashlib
from collections import OrderedDict


class PrefixCache:
    def __init__(self, block_size: int, salt: str):
        self.block_size = block_size
        self.root = hashlib.sha256(salt.encode()).digest()
        self.block_of: dict[bytes, int] = {}  # a chain hash -> the block holding that prefix's last block_size slots
        self.hash_of: dict[int, bytes] = {}
        self.parked: OrderedDict[int, None] = OrderedDict()  # blocks no row holds that keep their prefix, least recently used first

    def hashes(self, tokens: list[int], n_blocks: int) -> list[bytes]:
        """The chain hashes of the first n_blocks full blocks of the tokens."""
        chain, parent = [], self.root
        for start in range(0, n_blocks * self.block_size, self.block_size):
            block = tokens[start : start + self.block_size]
            parent = hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in block)).digest()
            chain.append(parent)
        return chain

    def lookup(self, prompt: list[int]) -> list[int]:
        """The cached blocks the prompt begins with, in slot order: full blocks before its last token."""
        found = []
        for chain in self.hashes(prompt, (len(prompt) - 1) // self.block_size):
            if chain not in self.block_of:
                break
            found.append(self.block_of[chain])
        return found

    def register(self, tokens: list[int], blocks: list[int]) -> None:
        """The row's blocks hold these tokens' keys and values from slot 0: its full blocks become findable."""
        for chain, block in zip(self.hashes(tokens, len(tokens) // self.block_size), blocks):
            if chain not in self.block_of and block not in self.hash_of:
                self.block_of[chain], self.hash_of[block] = block, chain

    def park(self, block: int) -> bool:
        """The last row let the block go: kept for a later hit if it holds a prefix (True), else it is plain free."""
        if block in self.hash_of:
            self.parked[block] = None
            return True
        return False

    def unpark(self, block: int) -> None:
        self.parked.pop(block, None)

    def evict(self) -> int:
        """The least recently used parked block, its prefix forgotten: free for any row."""
        block, _ = self.parked.popitem(last=False)
        del self.block_of[self.hash_of.pop(block)]
        return block
