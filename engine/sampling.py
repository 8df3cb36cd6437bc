"""Token selection inside the decode step: greedy, temperature, top-k, top-p.

Everything stays on the device and in fixed shapes (no .item(), no multinomial), so the step
can be compiled with fullgraph=True and captured as a CUDA graph. Random draws come from
torch's global generator: torch.manual_seed(seed) makes a run reproducible.
"""

from dataclasses import dataclass

import torch

from models.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0  # 1 means no nucleus filter

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")


def filter_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order transformers uses); removed tokens get -inf."""
    logits = logits.float() / config.temperature  # [B, V]
    if config.top_k:
        kth_best = torch.topk(logits, min(config.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if config.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass;
        # the best token is never dropped.
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Next token per row, [B] int64, from logits [B, V]."""
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, config).softmax(dim=-1)
    # argmax(p / E) with E ~ Exponential(1) draws from p (the exponential race), without a host sync.
    exponential = -torch.log(torch.rand_like(probs).clamp_min(1e-20))
    return (probs / exponential).argmax(dim=-1)
