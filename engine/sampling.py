"""Token selection inside the decode step: repetition penalty, then greedy or sampling through
temperature, top-k, top-p and min-p (the order transformers applies them in).

Each row has its own settings (RowSampling: [B] tensors, and their copy on the host), so one
batched step serves requests that each asked for something else. The host copy decides which
filters run at all (none of them for a greedy batch); the tensors hold each row's values, and a
row that asks for no filter passes through it unchanged. Everything stays on the device and in
fixed shapes (no .item(), no multinomial), so the step never waits for the host.

A CUDA graph replays the work recorded at its capture, host branches included, so under one the
settings are `static`: every filter runs for every row, top-k over the whole vocabulary, and the
tensors alone decide, so a row's settings may change between replays.

Random draws come from torch's global generator (torch.manual_seed makes a run reproducible), or,
for rows given a seed, from a hash of (seed, position, token): such a row draws the same numbers
whichever batch it runs in and whatever the other rows do, as a served request with a seed must.
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


class RowSampling:
    """Every row's sampling settings: `configs` on the host, the same values as [B] tensors on the
    device for the step to read. `seeds` [B]: each row's seed for the hashed draws; None draws
    from torch's global generator."""

    def __init__(self, configs: list[SamplingConfig], device: torch.device, seeded: bool = False):
        batch = len(configs)
        self.configs = list(configs)
        self.static = False  # every filter runs, whatever the host copy says (a CUDA graph's step)
        self.temperature = torch.zeros(batch, device=device)  # [B]
        self.top_k = torch.zeros(batch, dtype=torch.int64, device=device)  # [B]
        self.top_p = torch.ones(batch, device=device)  # [B]
        self.min_p = torch.zeros(batch, device=device)  # [B]
        self.penalty = torch.ones(batch, device=device)  # [B]
        self.seeds = torch.zeros(batch, dtype=torch.int64, device=device) if seeded else None  # [B]
        for row, config in enumerate(configs):
            self.set_row(row, config)

    @classmethod
    def same(cls, config: SamplingConfig, batch: int, device: torch.device) -> "RowSampling":
        return cls([config] * batch, device)

    def set_row(self, row: int, config: SamplingConfig, seed: int = 0) -> None:
        """Between steps: the row's settings from now on (and its seed, with seeded draws)."""
        self.configs[row] = config
        self.temperature[row] = config.temperature
        self.top_k[row] = config.top_k
        self.top_p[row] = config.top_p
        self.min_p[row] = config.min_p
        self.penalty[row] = config.repetition_penalty
        if self.seeds is not None:
            self.seeds[row] = seed

    def __getitem__(self, rows: slice) -> "RowSampling":
        """These rows' settings: views of the same tensors."""
        part = object.__new__(RowSampling)
        part.configs = self.configs[rows]
        part.static = self.static
        for name in ("temperature", "top_k", "top_p", "min_p", "penalty"):
            setattr(part, name, getattr(self, name)[rows])
        part.seeds = None if self.seeds is None else self.seeds[rows]
        return part

    @property
    def penalises_repetition(self) -> bool:
        """Whether the step applies the penalty (and needs the seen tokens): static settings always do."""
        return self.static or any(c.penalises_repetition for c in self.configs)

    @property
    def greedy(self) -> bool:
        return not self.static and all(c.temperature == 0 for c in self.configs)

    def top_k_everywhere(self) -> bool:
        """Whether every row keeps at most its top-k tokens, so that the filters need only look at those."""
        return not self.static and all(c.top_k > 0 for c in self.configs)

    def top_k_bound(self, vocab_size: int) -> int:
        """The k that bounds every row's top-k (0: no row filters)."""
        return vocab_size if self.static else min(max(c.top_k for c in self.configs), vocab_size)

    def filters_top_p(self) -> bool:
        return self.static or any(c.top_p < 1 for c in self.configs)

    def filters_min_p(self) -> bool:
        return self.static or any(c.min_p for c in self.configs)


def seen_tokens(prompts: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] bool, True for every token of each row's prompt: what the repetition penalty starts from."""
    seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        seen[row, torch.tensor(prompt, device=device)] = True
    return seen


def penalise_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor | float) -> torch.Tensor:
    """CTRL's penalty, as transformers applies it: a seen token's logit is divided by the penalty
    when positive and multiplied by it when negative, so a penalty > 1 always lowers it.
    penalty: one for all rows, or [B, 1]."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def filter_logits(logits: torch.Tensor, sampling: RowSampling | SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, each row with its own values; removed tokens get
    -inf. The best token is never removed. A greedy row (temperature 0) is left at temperature 1."""
    rows = as_rows(sampling, logits)
    temperature = torch.where(rows.temperature > 0, rows.temperature, 1.0)
    logits = logits.float() / temperature[:, None]  # [B, V]
    largest = rows.top_k_bound(logits.shape[-1])
    if largest:
        best = torch.topk(logits, largest, dim=-1).values  # [B, largest]
        k = rows.top_k.clamp(1, largest)  # a row without top-k reads some value, then ignores it
        kth_best = best.gather(-1, (k - 1)[:, None])
        logits = logits.masked_fill((logits < kth_best) & (rows.top_k > 0)[:, None], float("-inf"))
    if rows.filters_top_p():
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = (mass_before >= rows.top_p[:, None]) & (rows.top_p < 1)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if rows.filters_min_p():
        probs = logits.softmax(dim=-1)
        too_unlikely = probs < rows.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(too_unlikely, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, sampling: RowSampling | SamplingConfig, seen: torch.Tensor | None = None, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Next token per row, [B] int64, from logits [B, V]. `seen` [B, V] marks the tokens the
    repetition penalty applies to (required when a row has one); `positions` [B], the positions
    the new tokens will take, count the hashed draws of seeded rows (required with seeds)."""
    rows = as_rows(sampling, logits)
    if rows.penalises_repetition:
        logits = penalise_repetition(logits.float(), seen, rows.penalty[:, None])
    greedy = logits.max(dim=-1).indices  # [B] the first best token, as argmax gives it (which is 4x slower on CPU in 16 bits)
    if rows.greedy:
        return greedy
    scores, candidates = logits, torch.arange(logits.shape[-1], device=logits.device)  # [V] the token of each column
    if rows.top_k_everywhere():
        # Filter and draw among the best 2k tokens only, not the whole vocabulary: top-k keeps the
        # same tokens there unless more than k of them tie with the k-th best.
        scores, candidates = torch.topk(logits, min(2 * rows.top_k_bound(logits.shape[-1]), logits.shape[-1]), dim=-1)  # [B, K] each
    probs = filter_logits(scores, rows).softmax(dim=-1)
    # argmax(p / E), E ~ Exponential(1), draws from p without a host sync; uniforms float32, below 1 (E = 0 wins even at p = 0).
    uniform = torch.rand_like(probs, dtype=torch.float32) if rows.seeds is None else hashed_uniform(rows.seeds, positions, candidates)
    exponential = -torch.log(uniform.clamp_min(1e-20))
    drawn = candidates.expand_as(probs).gather(-1, (probs / exponential).argmax(dim=-1, keepdim=True))[:, 0]
    return torch.where(rows.temperature > 0, drawn, greedy)


def as_rows(sampling: RowSampling | SamplingConfig, logits: torch.Tensor) -> RowSampling:
    """One config stands for every row of the logits [B, V]."""
    return sampling if isinstance(sampling, RowSampling) else RowSampling.same(sampling, logits.shape[0], logits.device)


MASK_32 = 0xFFFFFFFF


def mix_32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of 32-bit values held in int64 (a multiply-xorshift finaliser; its constant
    is below 2**27, so no product overflows int64)."""
    for _ in range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B & MASK_32
    return (x >> 16) ^ x


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, V] numbers in (0, 1), one per (row's seed, position, token of `tokens` [V] or [B, V]),
    the same wherever the row runs."""
    key = mix_32(mix_32(seeds & MASK_32) ^ (positions & MASK_32))  # [B]
    bits = mix_32(key[:, None] ^ (tokens * 0x9E3779B1 & MASK_32)) >> 9  # [B, V] 23 random bits; the tokens spread apart
    return (bits.float() + 0.5) / (1 << 23)  # exact in float32: never 1.0
