"""How far keys per channel (kv/channel_keys.py) would drift if a KV policy compacted them.

    python -m results.channel_keys_drift

A compaction moves kept slots into blocks whose steps and minima were fitted to other slots, so
each kept key must be quantized again from its codes. This simulates StreamingLLM on 4-bit keys:
4 sink slots, 256 candidates and a window of 16; each compaction drops the 16 oldest candidates,
and 16 new keys arrive. The keys are Gaussian with 4 channels 20 times larger than the rest (as
Qwen2's key bias makes some). It prints each key's error in steps of its block, against the keys
never compacted, by how many compactions the key has been through.
"""

import torch

from kv import KV_CHANNEL_CODES
from kv.channel_keys import allocate_channel_keys

HEADS, CHANNELS, SINKS, CANDIDATES, WINDOW, DROPPED, BITS, BLOCK = 2, 64, 4, 256, 16, 16, 4, KV_CHANNEL_CODES["kc4v4"][1]


def stored(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys [1, H, S, D] written at once as kcN codes, read back; and each slot's step [1, H, S, D]."""
    S = keys.shape[2]
    codes = allocate_channel_keys(tuple(keys.shape), torch.float32, BITS, torch.device("cpu"), BLOCK)
    codes.write(keys, torch.arange(S)[None])
    step = codes.step[..., 0].float().repeat_interleave(BLOCK, dim=2)[:, :, :S]  # [1, H, NB, D] -> [1, H, S, D]
    return codes.read(S, torch.float32), step


def main() -> None:
    torch.manual_seed(0)
    scale = torch.ones(CHANNELS)
    scale[:4] = 20
    new_keys = lambda n: torch.randn(1, HEADS, n, CHANNELS) * scale  # [1, H, n, D]
    S = SINKS + CANDIDATES + WINDOW
    truth = new_keys(S)
    held, _ = stored(truth)
    age = torch.zeros(S, dtype=torch.long)  # compactions each slot has been through
    errors: dict[int, list[torch.Tensor]] = {}
    for _ in range(48):
        kept = torch.cat([torch.arange(SINKS), torch.arange(SINKS + DROPPED, S)])
        arriving = new_keys(DROPPED)
        truth = torch.cat([truth[:, :, kept], arriving], 2)
        # Each compaction quantizes the kept keys again from what the codes held.
        held, step = stored(torch.cat([held[:, :, kept], arriving], 2))
        age = torch.cat([age[kept] + 1, torch.zeros(DROPPED, dtype=torch.long)])
        error = ((held - truth).abs() / step)[0].transpose(0, 1)  # [S, H, D] in steps
        for a in age.unique().tolist():
            errors.setdefault(a, []).append(error[age == a].flatten())
    print("compactions | key channels | mean error (steps) | largest")
    for a in (0, 1, 2, 4, 8, 16, 32, 48):
        if a in errors:
            e = torch.cat(errors[a])
            print(f"{a:11d} | {e.numel():5d} | {e.mean():.3f} | {e.max():.2f}")


if __name__ == "__main__":
    main()
