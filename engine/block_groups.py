"""How the compiled step groups the model's blocks: consecutive blocks of one structure run as
one call of compiled code, and every group alike reuses one compiled graph (engine/compile.py's
torch.compile groups, engine/saved_step.py's packages)."""

import torch

BLOCKS_PER_GROUP = 6  # the most blocks one compiled call runs


def block_structure(block: torch.nn.Module) -> tuple:
    """What a compiled graph of a block depends on besides tensor values: its modules' kinds and
    its tensors' shapes and dtypes. A checkpoint imported from a GGUF file with mixed block types
    (Q4_K_M: some layers' matrices in 6 bits) has layers of two structures (int4 and int8)."""
    modules = tuple((name, type(m)) for name, m in block.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in block.state_dict().items())
    return modules, tensors


def group_size(structures: list[tuple]) -> int:
    """How many consecutive blocks one compiled call runs, up to BLOCKS_PER_GROUP, dividing the
    layers evenly: the size with the fewest distinct groups (each one a graph to compile), then
    the fewest calls per step. A model whose layers are all alike gets one graph."""
    n = len(structures)
    sizes = [size for size in range(1, BLOCKS_PER_GROUP + 1) if n % size == 0]
    return min(sizes, key=lambda size: (len(group_structures(structures, size)), n // size))


def group_structures(structures: list[tuple], size: int) -> set[tuple]:
    return {tuple(structures[first : first + size]) for first in range(0, len(structures), size)}
