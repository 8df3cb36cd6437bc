"""Prefill and the decode step: the two ways a token batch goes through the model.

Prefill appends each row's new tokens after what its cache holds (nothing, for a new prompt;
the conversation so far, for a chat turn), rows right-padded to the longest; the mask keeps
each row to its own real tokens, so padding never changes a result. The decode step reads the
row lengths from the device and, called without a read bound, has the same shapes on every
call, so it can be compiled (fullgraph) and captured as a CUDA graph.
"""

from functools import partial

import torch

from compression.manager import CompressionManager, PerRowManagers
from engine.kv_cache import KVCache
from engine.paged_cache import PagedKVCache
from engine.sampling import RowSampling, SamplingConfig, sample
from models.kv_layers import CacheRead, tapped
from models.transformer import BlockGroups, Transformer


def prefill(
    model: Transformer,
    cache: KVCache | PagedKVCache,
    prompts: list[list[int]],
    all_logits: bool = False,
    compression: CompressionManager | None = None,
) -> torch.Tensor:
    """Append the prompts to each row's cache: slots length..length+len-1, positions
    position..position+len-1. Logits [B, V] at each prompt's last token, or [B, T, V] at every
    position with all_logits. Into an empty cache the prompts become the protected prefix and
    seed the compression manager, if any; after it, the manager counts them as generated."""
    device = cache.length.device
    B, T = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros(B, T, dtype=torch.int64, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    held = cache.length.tolist()  # slots already in use per row, read once on the host
    steps = torch.arange(T, device=device)
    write_slots = cache.length[:, None] + steps  # [B, T]
    positions = cache.position[:, None] + steps  # [B, T]
    mask = None  # an empty cache and no padding: plain causal attention, which SDPA computes without a mask
    if max(held) > 0 or any(len(p) != T for p in prompts):
        slots = torch.arange(max(held) + T, device=device)
        causal = slots[None, None, :] <= write_slots[:, :, None]  # [B, T, S] query i reads the slots up to its own
        real = slots[None, None, :] < (cache.length + lengths)[:, None, None]  # [B, 1, S] not padding
        mask = (causal & real).unsqueeze(1)  # [B, 1, T, S]
    # Only the first max(held) + T slots can hold anything yet: attend over that view of the cache.
    layers = cache.layers(max(held) + T)
    fresh = max(held) == 0
    tails = []  # a chat turn: each layer's last queries [B, H, <=n_recent, D], for the recent ring

    def keep_tail(queries: torch.Tensor) -> None:
        tails.append(queries[:, :, -compression.config.n_recent :].clone())  # a copy: a slice would pin the layer's q/k/v

    if compression is not None:  # the KV policy takes each layer's queries as it finishes: no layer's outlive it
        taps = [partial(compression.seed_layer, layer, prompt_lengths=lengths) for layer in range(len(layers))] if fresh else [keep_tail] * len(layers)
        layers = tapped(layers, taps)
    logits = model(tokens, positions, CacheRead(layers, write_slots, mask), logit_index=None if all_logits else lengths - 1)
    if tails:
        compression.append(torch.stack(tails), [len(p) for p in prompts])
    if fresh:
        cache.prompt_length.copy_(lengths)
    cache.length += lengths
    cache.position += lengths
    if fresh and compression is not None:
        compression.compress_prompt()
    return logits


def decode_step(
    model: Transformer,
    cache: KVCache | PagedKVCache,
    tokens: torch.Tensor,  # [B] the tokens to feed; overwritten with the next ones
    finished: torch.Tensor,  # [B] bool, updated in place
    eos_ids: torch.Tensor,  # [E] int64
    sampling: SamplingConfig | RowSampling,
    compression: CompressionManager | PerRowManagers | None = None,
    n_read: int | None = None,
    seen: torch.Tensor | None = None,  # [B, V] bool, the tokens the repetition penalty applies to; updated in place
    groups: BlockGroups | None = None,  # the compiled blocks (engine/compile.py); None: eager
) -> torch.Tensor:
    """Feed one token per row, sample the next, advance the counters; returns the logits [B, V].
    Each layer writes its queries into the compression manager's static buffer, if there is one,
    which then records them.

    n_read: attend over the first n_read slots only, a bound the host knows (every row's length
    + 1 must fit); None reads the whole buffer, the one static shape a compiled step or a CUDA
    graph needs. Attention time grows with the slots read."""
    slots = cache.length[:, None]  # [B, 1]
    slot_ids = cache.slot_ids if n_read is None else cache.slot_ids[:n_read]
    mask = (slot_ids[None, :] <= slots)[:, None, None, :]  # [B, 1, 1, S] slots in use + the new one
    layers = cache.layers(n_read)
    if compression is not None:
        layers = tapped(layers, list(compression.step_queries))  # [B, H, 1, D] each
    logits = model(tokens[:, None], cache.position[:, None], CacheRead(layers, slots, mask), groups=groups)
    if compression is not None:
        compression.record(compression.step_queries, cache.position)
    logits = logits[:, 0]  # [B, V]
    if seen is not None:
        seen.scatter_(1, tokens[:, None], True)
    cache.length += 1
    cache.position += 1  # now the position the sampled token takes, which seeded draws count by
    # A finished row keeps running (shapes are static), feeding its last token again: a real
    # token id, which EOS is not when a model has none (its stand-in, -1, is no embedding row).
    next_tokens = torch.where(finished, tokens, sample(logits, sampling, seen, cache.position))
    finished |= torch.isin(next_tokens, eos_ids)
    tokens.copy_(next_tokens)
    return logits


def advanced_by_step(
    cache: KVCache | PagedKVCache, tokens: torch.Tensor, finished: torch.Tensor, seen: torch.Tensor | None, compression: CompressionManager | PerRowManagers | None
) -> list[torch.Tensor]:
    """The small tensors decode_step advances in place, beside the K/V it writes: whoever runs the
    step for another purpose (a CUDA graph's warm-up) must put these back afterwards."""
    state = [cache.length, cache.position, tokens, finished]
    if seen is not None:
        state.append(seen)
    if compression is not None:
        state += compression.step_state()
    return state
