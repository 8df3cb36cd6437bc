"""Prefix compression: after a prefill into an empty cache, a long prompt keeps its first
PREFIX_SINKS and last prefix_tail tokens and the prefix_budget best-scored of those between (per
layer and KV head), scored once by the policy with the prompt's last queries (and BeaconKV's first
beacons). The kept prompt becomes the protected prefix; positions do not move."""

from collections.abc import Callable

import torch

from compression.cache import Cache
from compression.config import PREFIX_SINKS, CompressionConfig
from compression.scoring import rotate_to_position
from models.rope import apply_rope


def compress_prompt(
    cache: Cache,
    config: CompressionConfig,
    beacons: torch.Tensor,  # [L, B, H, n_beacon, D]
    prompt_tail: torch.Tensor,  # [L, B, H, R, D] the prompt's last queries, before RoPE
    rope_cos: torch.Tensor,  # [max_positions, D]
    rope_sin: torch.Tensor,
    best: Callable[..., torch.Tensor],  # the manager's: (count, **ScoringInputs of one layer) -> kept offsets [B, H_kv, count]
) -> torch.Tensor:
    """Compress every row's prompt that is long enough, in place; returns the positions
    [L, B, H_kv, T] its slots hold afterwards (T the longest prompt)."""
    L, B, H_kv, _, D = cache.slot_shape()
    device = cache.device
    T = int(cache.prompt_length.max())
    positions = torch.arange(T, device=device).expand(L, B, H_kv, T).clone()
    R = prompt_tail.shape[3]
    for b, P in enumerate(cache.prompt_length.tolist()):
        n_candidates = P - PREFIX_SINKS - config.prefix_tail
        if n_candidates <= config.prefix_budget:
            continue
        issued_at = torch.arange(P - R, P, device=device)[None]  # [1, R]
        now = torch.tensor([P], device=device)
        candidate_slots = PREFIX_SINKS + torch.arange(n_candidates, device=device)[None]  # [1, C]
        row = cache.row(b)
        keep = []
        for layer in range(L):
            context = row.keys(layer, P)  # [1, H_kv, P, D]
            keep.append(best(
                config.prefix_budget,
                beacons=rotate_to_position(beacons[layer, b : b + 1], rope_cos[now], rope_sin[now]),
                recent=apply_rope(prompt_tail[layer, b : b + 1], rope_cos[issued_at], rope_sin[issued_at]),
                keys=context[:, :, PREFIX_SINKS : PREFIX_SINKS + n_candidates],
                context=context,
                visible=(torch.arange(P, device=device) <= issued_at[0, :, None]).expand(1, H_kv, R, P),
                in_use=torch.ones(1, P, dtype=torch.bool, device=device),
                candidate_slots=candidate_slots,
            ))
        sinks = torch.tensor([PREFIX_SINKS], device=device)
        row.compact([positions[:, b : b + 1]], sinks, torch.stack(keep), n_candidates, config.prefix_tail)
        cache.prompt_length[b] = cache.length[b] = PREFIX_SINKS + config.prefix_budget + config.prefix_tail
    return positions
