"""Token selection inside the decode step: repetition penalty, then greedy or sampling through
temperature, top-k, top-p and min-p (the order transformers applies them in).

Everything stays on the device and in fixed shapes (no .item(), no multinomial), so the step
can be compiled with fullgraph=True and captured as a CUDA graph. Random draws come from
torch's global generator: torch.manual_seed(seed) makes a run reproducible.
"""

from dataclasses import dataclass

import torch

from errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0  # 1 means no nucleus filter
    min_p: float = 0.0  # 0 means no min-p filter
    repetition_penalty: float = 1.0  # 1 means no penalty; applies to greedy decoding too

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min-p must be in [0, 1] (0 turns it off), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise UserError(f"repetition penalty must be > 0 (1 turns it off), got {self.repetition_penalty}")

    @property
    def penalises_repetition(self) -> bool:
        return self.repetition_penalty != 1.0


def seen_tokens(prompts: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] bool, True for every token of each row's prompt: what the repetition penalty starts from."""
    seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        seen[row, torch.tensor(prompt, device=device)] = True
    return seen


def penalise_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty, as transformers applies it: a seen token's logit is divided by the penalty
    when positive and multiplied by it when negative, so a penalty > 1 always lowers it."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def filter_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; removed tokens get -inf. The best token is never removed."""
    logits = logits.float() / config.temperature  # [B, V]
    if config.top_k:
        kth_best = torch.topk(logits, min(config.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if config.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if config.min_p:
        probs = logits.softmax(dim=-1)
        too_unlikely = probs < config.min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(too_unlikely, float("-inf"))
    return logits


def sample(logits: torch.Tensor, config: SamplingConfig, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row, [B] int64, from logits [B, V]; `seen` [B, V] marks the tokens the
    repetition penalty applies to (required when the config has one)."""
    if config.penalises_repetition:
        logits = penalise_repetition(logits.float(), seen, config.repetition_penalty)
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, config).softmax(dim=-1)
    # argmax(p / E) with E ~ Exponential(1) draws from p (the exponential race), without a host sync.
    exponential = -torch.log(torch.rand_like(probs).clamp_min(1e-20))
    return (probs / exponential).argmax(dim=-1)
