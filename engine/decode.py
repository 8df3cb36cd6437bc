"""Prefill and the decode step: the two ways a token batch goes through the model.

Prefill appends each row's new tokens after what its cache holds (nothing, for a new prompt;
the conversation so far, for a chat turn), rows right-padded to the longest; the mask keeps
each row to its own real tokens, so padding never changes a result. The decode step reads the
row lengths from the device and, called without a read bound, has the same shapes on every
call, so it can be compiled (fullgraph) and captured as a CUDA graph.

Both take the cache as any cache kind (kv/: `cache: KVCache` stands for all of them, which share
its verbs) and, optionally, a KV policy (KVPolicy): an object that wraps the layers' views to keep
what it scores with, and is told when tokens have entered the cache.
"""

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.sampling import RowSampling, SamplingConfig, sample
from kv.cache import KVCache
from models.transformer import BlockGroups, CacheRead, LayerKV, Transformer


class KVPolicy(Protocol):
    """What the engine asks of a KV policy (compression/manager.py's CompressionManager)."""

    def prefill_views(self, layers: list[LayerKV], prompt_lengths: torch.Tensor, fresh: bool) -> list[LayerKV]:
        """A prefill's views of the layers (fresh: into an empty cache)."""

    def prefilled(self, n_new: list[int], fresh: bool) -> None:
        """After a prefill, the counters advanced."""

    def decode_views(self, layers: list[LayerKV]) -> list[LayerKV]:
        """A decode step's views of the layers."""

    def after_decode(self, positions: torch.Tensor) -> None:
        """Inside the decode step, after the forward; positions [B] of the tokens fed."""

    def after_step(self) -> bool:
        """Between steps; whether the cache was compacted (its lengths shrank)."""

    def step_state(self) -> list[torch.Tensor]:
        """The tensors after_decode overwrites."""

    def reset(self) -> None: ...

    @property
    def nbytes(self) -> int:
        """What it holds beside the cache that counts as KV memory (a store)."""

    @property
    def stats(self) -> Any: ...


class LogitsHook(Protocol):
    """Per-row rules for the logits (engine/logit_rules.py): `adjust` the logits [B, V] the sampler
    sees; `record` the sampled tokens [B] beside the raw logits."""

    def adjust(self, logits: torch.Tensor, rows: slice) -> torch.Tensor: ...
    def record(self, logits: torch.Tensor, tokens: torch.Tensor, rows: slice) -> None: ...


@dataclass
class StepState:
    """What a decode step reads and advances besides the cache: the same tensors for a whole
    session, so that a compiled step or a CUDA graph keeps pointing at them."""

    tokens: torch.Tensor  # [B] int64 the tokens to feed; overwritten with the next ones
    finished: torch.Tensor  # [B] bool, updated in place
    eos: torch.Tensor  # [E] int64
    sampling: SamplingConfig | RowSampling
    seen: torch.Tensor | None = None  # [B, V] bool, the tokens the repetition penalty applies to; updated in place
    blocks: BlockGroups | None = None  # how the blocks run: compiled groups (engine/compile.py), None eager
    logits_hook: LogitsHook | None = None  # a served request's penalties, bias and log-probabilities

    def advanced(self) -> list[torch.Tensor]:
        """The tensors the step overwrites."""
        return [self.tokens, self.finished] + ([] if self.seen is None else [self.seen])


def prefill(model: Transformer, cache: KVCache, prompts: list[list[int]], all_logits: bool = False, policy: KVPolicy | None = None) -> torch.Tensor:
    """Append the prompts to each row's cache: slots length..length+len-1, positions
    position..position+len-1. Logits [B, V] at each prompt's last token, or [B, T, V] at every
    position with all_logits. Into an empty cache the prompts become the protected prefix."""
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
    if policy is not None:
        layers = policy.prefill_views(layers, lengths, fresh)
    logits = model(tokens, positions, CacheRead(layers, write_slots, mask), logit_index=None if all_logits else lengths - 1)
    if fresh:
        cache.prompt_length.copy_(lengths)
    cache.length += lengths
    cache.position += lengths
    if policy is not None:
        policy.prefilled([len(p) for p in prompts], fresh)
    return logits


def decode_step(model: Transformer, cache: KVCache, state: StepState, policy: KVPolicy | None = None, n_read: int | None = None) -> torch.Tensor:
    """Feed one token per row, sample the next, advance the counters; returns the logits [B, V].

    n_read: attend over the first n_read slots only, a bound the host knows (every row's length
    + 1 must fit); None reads the whole buffer, the one static shape a compiled step or a CUDA
    graph needs. Attention time grows with the slots read."""
    slots = cache.length[:, None]  # [B, 1]
    slot_ids = cache.slot_ids if n_read is None else cache.slot_ids[:n_read]
    mask = (slot_ids[None, :] <= slots)[:, None, None, :]  # [B, 1, 1, S] slots in use + the new one
    layers = cache.layers(n_read)
    if policy is not None:
        layers = policy.decode_views(layers)
    logits = model(state.tokens[:, None], cache.position[:, None], CacheRead(layers, slots, mask), groups=state.blocks)
    if policy is not None:
        policy.after_decode(cache.position)
    logits = logits[:, 0]  # [B, V]
    if state.seen is not None:
        state.seen.scatter_(1, state.tokens[:, None], True)
    cache.length += 1
    cache.position += 1  # now the position the sampled token takes, which seeded draws count by
    # A finished row keeps running (shapes are static), feeding its last token again: a real
    # token id, which EOS is not when a model has none (its stand-in, -1, is no embedding row).
    hook = state.logits_hook
    sampled = sample(logits if hook is None else hook.adjust(logits, slice(None)), state.sampling, state.seen, cache.position)
    next_tokens = torch.where(state.finished, state.tokens, sampled)
    if hook is not None:
        hook.record(logits, next_tokens, slice(None))
    state.finished |= torch.isin(next_tokens, state.eos)
    state.tokens.copy_(next_tokens)
    return logits
