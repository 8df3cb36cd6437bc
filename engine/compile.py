"""Compiling the decode step a few transformer blocks at a time (regional compilation).

Every layer runs the same code on weights of the same shapes, so a group of consecutive blocks is
compiled once and every group of the model reuses the compiled code: the weights and the cache
layers are the compiled graph's inputs, not its constants. A cold compile then costs one group's,
not the whole unrolled step's. The number of slots read is a variable of the compiled code, so
the step reads only the slots in use, as the eager one does, and one compile serves every token
and every cache size. One block per group compiles fastest but pays the call into
compiled code once per layer; a few blocks per group pay it a few times per step
(docs/performance.md has the measurements behind BLOCKS_PER_GROUP).

The rest of the step (the embedding lookup, RoPE rows, the LM head, sampling) stays eager: a few
ops per token against a few hundred in the blocks. Prefill stays eager too: its shapes change with
every prompt, and its products are large enough that compiling saves little.
"""

from collections.abc import Callable

import torch

from engine.block_groups import block_structure, group_size, group_structures
from engine.cpu import inductor_options
from engine.decode import StepState
from models.parallel import RankTransformer
from models.transformer import BlockGroups, LayerKV, Transformer, run_blocks

def compile_blocks(model: Transformer) -> tuple[BlockGroups, bool]:
    """The model's blocks as compiled groups, for `model(..., groups=...)`, and whether one graph
    serves every group (CompiledStep)."""
    compiled = torch.compile(run_blocks, fullgraph=True, options=inductor_options(model.device, isinstance(model, RankTransformer)))
    structures = [block_structure(block) for block in model.layers]
    size = group_size(structures)
    marked = False

    def run(blocks, x, inputs, kvs):
        nonlocal marked
        if not marked:  # once: the graph it compiles takes every later size
            mark_slots_dynamic(inputs.mask, kvs)
            marked = True
        return compiled(blocks, x, inputs, kvs)

    return BlockGroups(run, size), len(group_structures(structures, size)) == 1


class CompiledStep:
    """A decode step that runs compiled blocks. The first call (which compiles, or loads inductor's
    cache) checks torch.compile's guards against these very objects, tracing without duck sizing:
    sizes equal by chance in one group (k8v4's key and value codes of two layers start at one
    offset) must not become a guard the next group fails. With one graph for every group, later
    calls skip the guards (only tensor values change); with several, the guards choose the graph."""

    def __init__(self, advance: Callable[..., object], unguarded: bool):
        self.advance, self.unguarded = advance, unguarded
        self.called = False

    def __call__(self, **kwargs) -> None:
        stance = torch.compiler.set_stance(skip_guard_eval_unsafe=self.unguarded) if self.called else torch.fx.experimental._config.patch(use_duck_shape=False)
        with stance:
            self.advance(**kwargs)
        self.called = True


def mark_slots_dynamic(mask: torch.Tensor | None, kvs: list[LayerKV]) -> None:
    """The number of slots read is a size the compiled code takes as a variable, from its first
    call on: one graph then serves a step that reads only the slots in use (their count grows by
    one per token), every cache size, and, through inductor's on-disk cache, every later run."""
    if mask is not None:
        torch._dynamo.maybe_mark_dynamic(mask, 3)  # [B, 1, T, S]
    for kv in kvs:
        for tensor, dim in kv.slots_read():
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


class Compiled:
    """The runner whose step runs compiled groups of blocks, reading only the slots in use."""

    builds = True
    whole_cache = False
    graph = False

    def build(self, model: Transformer, step: Callable[..., object], state: StepState, advanced: list[torch.Tensor]) -> CompiledStep:
        state.blocks, one_graph = compile_blocks(model)
        return CompiledStep(step, unguarded=one_graph)
