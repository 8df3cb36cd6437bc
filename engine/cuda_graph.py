"""CUDA graph capture of the decode step: recorded once per run, replayed for every token.

The step reads everything from fixed tensors (tokens, cache buffers, lengths, positions, the
compression query buffer) and writes its results into them, so one recording serves every
token. Compaction between replays rewrites the same buffers in place, which keeps the graph valid.
"""

from collections.abc import Callable

import torch


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
