"""CUDA graph capture of the decode step: recorded once per run, replayed for every token.

The step reads everything from fixed tensors (tokens, cache buffers, lengths, positions, the
compression query buffer) and writes its results into them, so one recording serves every
token. Compaction between replays rewrites the same buffers in place, which keeps the graph valid.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.compile import compile_blocks
from engine.decode import StepState
from models.transformer import Transformer


def capture_decode_step(step: Callable[[], object], state: list[torch.Tensor]) -> Callable[[], None]:
    """Warm `step` up on a side stream, record it, and return a function that replays it.

    `state` lists the small tensors the step advances (lengths, positions, tokens...): warm-up
    really runs the step, so they are put back afterwards. The K/V it wrote went to slot
    `length`, which the next real step overwrites before anything reads it.
    """
    saved = [t.clone() for t in state]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # lets cuBLAS and the allocator settle before recording
            step()
            for t, s in zip(state, saved):
                t.copy_(s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recording does not run the kernels: the state is untouched
        step()
    return graph.replay


@dataclass(frozen=True)
class Graph:
    """The runner that captures the step (its blocks compiled first, with `compile`) as a CUDA
    graph and replays it: one shape, the whole cache read, no branch on a host value."""

    compile: bool = False
    builds = True
    whole_cache = True
    graph = True

    def build(self, model: Transformer, step: Callable[..., object], state: StepState, advanced: list[torch.Tensor]) -> Callable[[], None]:
        if self.compile:
            state.blocks = compile_blocks(model)[0]
        return capture_decode_step(step, advanced)
