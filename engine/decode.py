"""Prefill and the decode step: the two ways a token batch goes through the model.

Prefill runs every prompt token once, rows right-padded to the longest prompt; the mask keeps
each row to its own real tokens, so padding never changes a result. The decode step has the
same shapes on every call and reads the row lengths from the device, so it can be compiled
(fullgraph) and captured as a CUDA graph.
"""

import torch

from compression.manager import CompressionManager
from engine.kv_cache import KVCache
from engine.sampling import SamplingConfig, sample
from models.transformer import Transformer


def prefill(
    model: Transformer,
    cache: KVCache,
    prompts: list[list[int]],
    all_logits: bool = False,
    compression: CompressionManager | None = None,
) -> torch.Tensor:
    """Write the prompts into slots 0..len-1 of each row. Logits [B, V] at each prompt's last token,
    or [B, T, V] at every position with all_logits. The compression manager, if any, is seeded
    with the prompt's queries."""
    device = cache.k.device
    B, T = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros(B, T, dtype=torch.int64, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    steps = torch.arange(T, device=device)
    positions = steps.expand(B, T)
    mask = None  # no padding: plain causal attention, which SDPA computes without a mask
    if any(len(p) != T for p in prompts):
        causal = steps[None, :, None] >= steps[None, None, :]  # [1, T, T] query i reads key j <= i
        in_prompt = steps[None, None, :] < lengths[:, None, None]  # [B, 1, T] key j is a real token
        mask = (causal & in_prompt).unsqueeze(1)  # [B, 1, T, T]
    # Only the first T slots can hold anything yet: attend over that view of the cache.
    k, v = cache.k[:, :, :, :T], cache.v[:, :, :, :T]
    logit_index = None if all_logits else lengths - 1
    if compression is not None:
        logits, queries = model(tokens, positions, k, v, positions, mask, logit_index, return_queries=True)
        compression.seed(queries, lengths)
    else:
        logits = model(tokens, positions, k, v, positions, mask, logit_index)
    cache.length.copy_(lengths)
    cache.position.copy_(lengths)
    cache.prompt_length.copy_(lengths)
    return logits


def decode_step(
    model: Transformer,
    cache: KVCache,
    tokens: torch.Tensor,  # [B] the tokens to feed; overwritten with the next ones
    finished: torch.Tensor,  # [B] bool, updated in place
    eos_ids: torch.Tensor,  # [E] int64
    sampling: SamplingConfig,
    compression: CompressionManager | None = None,
    n_read: int | None = None,
) -> torch.Tensor:
    """Feed one token per row, sample the next, advance the counters; returns the logits [B, V].
    The compression manager, if any, records this step's queries into its static buffer.

    n_read: attend over the first n_read slots only, a bound the host knows (every row's length
    + 1 must fit); None reads the whole buffer, the one static shape a compiled step or a CUDA
    graph needs. Attention time grows with the slots read: bfloat16 SDPA over 2176 slots took
    twice as long as over half of them."""
    slots = cache.length[:, None]  # [B, 1]
    k, v, slot_ids = cache.k, cache.v, cache.slot_ids
    if n_read is not None:
        k, v, slot_ids = k[:, :, :, :n_read], v[:, :, :, :n_read], slot_ids[:n_read]
    mask = (slot_ids[None, :] <= slots)[:, None, None, :]  # [B, 1, 1, S] slots in use + the new one
    inputs = (tokens[:, None], cache.position[:, None], k, v, slots, mask)
    if compression is not None:
        logits, queries = model(*inputs, return_queries=True)
        compression.record(queries)
    else:
        logits = model(*inputs)
    logits = logits[:, 0]  # [B, V]
    # A finished row keeps running (shapes are static) but only ever emits EOS again.
    next_tokens = torch.where(finished, eos_ids[0], sample(logits, sampling))
    finished |= torch.isin(next_tokens, eos_ids)
    tokens.copy_(next_tokens)
    cache.length += 1
    cache.position += 1
    return logits
