"""What a served request asks of the logits beyond sampling, row by row inside the step: presence
and frequency penalties, a logit bias, and the log-probabilities it wants back.

The penalties count the tokens the row has generated (not its prompt), as the OpenAI API defines
them: a token's logit loses frequency_penalty for each time it was generated and presence_penalty
once if it was. The bias is added to the logits. Both apply before the sampler (engine/sampling.py),
so greedy rows follow them too.

Log-probabilities are the model's own distribution, log_softmax of the raw logits: before the
bias, the penalties, temperature and the filters (what llama.cpp's and vLLM's servers return by
default). The step computes them for every row while one row asks (a fixed shape), and the host
reads them only then.

A token mask (a grammar: structured output, server/structured.py) says which tokens may come
next. The host fills its bits before each prefill or step and hands it the token that came after;
the blocked tokens' logits become -inf before everything else, so no setting can sample them.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from errors import UserError

MOST_TOP_LOGPROBS = 20  # the OpenAI API's bound on top_logprobs


@dataclass(frozen=True)
class LogitRules:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    top_logprobs: int | None = None  # None: no log-probabilities; 0: the sampled token's; k: and the k likeliest

    def __post_init__(self):
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MOST_TOP_LOGPROBS:
            raise UserError(f"top_logprobs must be in 0..{MOST_TOP_LOGPROBS}, got {self.top_logprobs}")

    @property
    def penalises(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


class TokenMask(Protocol):
    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Bits of the tokens that may come next into bitmask[row] ([B, ceil(V / 32)] int32, host)."""

    def accept(self, token: int) -> None:
        """The token that came."""


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability, and the likeliest tokens' (best first)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class RowLogits:
    """Every row's rules as tensors on the device ([B] and [B, V]), their copy on the host (which
    decides what runs at all), and the log-probabilities the last prefill or step recorded."""

    def __init__(self, batch: int, vocab_size: int, device: torch.device):
        self.rules = [LogitRules()] * batch
        self.counts = torch.zeros(batch, vocab_size, dtype=torch.int32, device=device)  # [B, V] times generated
        self.bias = torch.zeros(batch, vocab_size, device=device)  # [B, V]
        self.presence = torch.zeros(batch, device=device)  # [B]
        self.frequency = torch.zeros(batch, device=device)  # [B]
        self.chosen = torch.zeros(batch, dtype=torch.float64, device=device)  # [B] the sampled token's logprob
        self.top = torch.zeros(batch, MOST_TOP_LOGPROBS, 2, dtype=torch.float64, device=device)  # [B, K, (logprob, id)]
        self.masks: list[TokenMask | None] = [None] * batch
        self.bitmask = torch.zeros(batch, -(-vocab_size // 32), dtype=torch.int32)  # [B, W] host, bit t of word t // 32: token t allowed
        self.bits = torch.arange(32, dtype=torch.int32, device=device)  # [32]

    def check(self, rules: LogitRules) -> None:
        vocab_size = self.bias.shape[1]
        for token, _ in rules.logit_bias:
            if not 0 <= token < vocab_size:
                raise UserError(f"logit_bias: token id {token} is not in the vocabulary (0..{vocab_size - 1})")

    def set_row(self, row: int, rules: LogitRules, mask: TokenMask | None = None) -> None:
        """Between steps, as a request joins the row: its rules and mask, its counts back to zero."""
        self.check(rules)
        self.rules[row], self.masks[row] = rules, mask
        self.counts[row] = 0
        self.bias[row] = 0
        for token, bias in rules.logit_bias:
            self.bias[row, token] = bias
        self.presence[row] = rules.presence_penalty
        self.frequency[row] = rules.frequency_penalty

    def adjust(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        """The logits [B, V] of these rows as the sampler must see them."""
        rules = self.rules[rows]
        masked = [row for row, mask in enumerate(self.masks[rows], rows.start or 0) if mask is not None]
        if masked:
            logits = logits.masked_fill(self._blocked(masked, rows, logits.shape[-1]), float("-inf"))
        if any(r.logit_bias for r in rules):
            logits = logits.float() + self.bias[rows]
        if any(r.penalises for r in rules):
            counts = self.counts[rows]
            logits = logits.float() - self.frequency[rows, None] * counts - self.presence[rows, None] * (counts > 0)
        return logits

    def _blocked(self, masked: list[int], rows: slice, vocab_size: int) -> torch.Tensor:
        """[B, V] True for the tokens the masked rows' grammars forbid now."""
        for row in masked:
            self.masks[row].fill(self.bitmask, row)
        words = self.bitmask[rows].to(self.bits.device)  # [B, W]
        allowed = (words[:, :, None] >> self.bits & 1).flatten(1)[:, :vocab_size].bool()  # [B, V]
        has_mask = torch.tensor([mask is not None for mask in self.masks[rows]], device=self.bits.device)
        return ~allowed & has_mask[:, None]

    def accept(self, row: int, token: int) -> None:
        """Between steps: the row's new token, for its mask."""
        if self.masks[row] is not None:
            self.masks[row].accept(token)

    def record(self, logits: torch.Tensor, tokens: torch.Tensor, rows: slice) -> None:
        """After sampling: count the tokens [B], and keep their log-probabilities from the raw logits [B, V]."""
        rules = self.rules[rows]
        if any(r.penalises for r in rules):
            self.counts[rows].scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.int32))
        wanted = [r.top_logprobs for r in rules if r.top_logprobs is not None]
        if not wanted:
            return
        logprobs = logits.float().log_softmax(dim=-1)  # [B, V]
        self.chosen[rows] = logprobs.gather(1, tokens[:, None])[:, 0].double()
        if max(wanted):
            best = logprobs.topk(max(wanted), dim=-1)  # [B, k]
            top = self.top[rows, : max(wanted)]
            top[..., 0] = best.values
            top[..., 1] = best.indices.double()  # exact: token ids are far below 2**53

    def logprobs(self, rows: list[int], tokens: list[int]) -> list[TokenLogprobs]:
        """The recorded log-probabilities of these rows' sampled tokens, in one read."""
        both = torch.cat([self.chosen[rows, None, None].expand(-1, 1, 2), self.top[rows]], dim=1).tolist()  # [R, 1 + K, 2]
        return [
            TokenLogprobs(token, read[0][0], [(int(i), value) for value, i in read[1 : 1 + self.rules[row].top_logprobs]])
            for row, token, read in zip(rows, tokens, both)
        ]
