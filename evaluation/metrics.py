"""What tasks 1, 3, 4 and 5 measure on a run (retrieval, streaming loss, continuation fidelity,
cost), and the results of every task by policy and budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from evaluation.future_attention import RecallShares
from evaluation.runs import Batch, Run
from weights.tokenizer import Tokenizer


@dataclass
class RetrievalResult:
    success: float
    hits: list[bool]  # per recall, trace by trace
    distances: list[int]  # tokens between the statement and the recall
    kept: list[float] = field(default_factory=list)  # per recall: share of the (layer, KV head) caches holding the whole stated value then
    hinted: list[bool] = field(default_factory=list)  # per recall: its trace has revisit hints

    @property
    def kept_mean(self) -> float:
        return sum(self.kept) / len(self.kept) if self.kept else float("nan")


def retrieval(run: Run, batch: Batch, tokenizer: Tokenizer) -> RetrievalResult:
    """A recall succeeds when each answer token is the argmax given the ones before it (so greedy
    decoding writes the value) and the token after the value is not one more digit."""
    hits, distances, kept, hinted = [], [], [], []
    watched = 0  # index into batch.watched, which lists the recalls in this order
    for b, row in enumerate(batch.rows):
        for r in row.recalls:
            answer = range(r.start, r.start + r.n_tokens)
            exact = all(int(run.predicted[b, t]) == row.forced[t] for t in answer)
            after = tokenizer.decode([int(run.predicted[b, r.start + r.n_tokens])]).strip()
            hits.append(exact and not after[:1].isdigit())
            distances.append(r.distance)
            hinted.append(row.hints)
            # The cache that predicts the answer: as the last compaction before that step left it.
            before = [c for c in run.compactions if c.step < r.start]
            kept.append(before[-1].watched[watched].item() if before else 1.0)
            watched += 1
    return RetrievalResult(sum(hits) / max(len(hits), 1), hits, distances, kept, hinted)


@dataclass
class LossResult:
    nll: float  # mean over the source tokens predicted after the first compaction
    nll_full: float  # the full cache's on the same tokens
    n_tokens: int

    @property
    def delta(self) -> float:
        return self.nll - self.nll_full


def streaming_loss(run: Run, full: Run, rows: list[int], first_scored: int) -> LossResult:
    nll, nll_full = -run.logprob[rows, first_scored:], -full.logprob[rows, first_scored:]
    return LossResult(nll.mean().item(), nll_full.mean().item(), nll.numel())


@dataclass
class ContinuationResult:
    leading: float  # tokens equal to the full cache's before the first difference (mean over prompts)
    agreement: float  # share of the tokens equal to the full cache's
    n_tokens: int  # tokens compared per prompt: those generated after the first compaction


def continuation(run: Run, full: Run, rows: list[int], first_affected: int) -> ContinuationResult:
    same = run.predicted[rows, first_affected:] == full.predicted[rows, first_affected:]  # [B', T']
    return ContinuationResult(same.cumprod(-1).sum(-1).float().mean().item(), same.float().mean().item(), same.shape[1])


@dataclass
class CostResult:
    tokens_per_s: float  # decode throughput of the batch, compactions and refreshes included
    ms_per_compaction: float
    ms_per_refresh: float
    kv_cache_mib: float  # the whole batch's static cache
    query_buffer_mib: float
    rows: int
    kv_share: float = float("nan")  # its bytes (codes, scales, store and its page summaries) over a full cache's in bf16


def cost(run: Run, rows: int, full_bf16_bytes: int) -> CostResult:
    def mean_ms(xs: list[float]) -> float:
        return 1000 * sum(xs) / len(xs) if xs else float("nan")

    s = run.stats
    return CostResult(
        rows * run.steps / run.seconds if run.seconds > 0 else float("nan"),
        mean_ms(s.compaction_s),
        mean_ms(s.refresh_s),
        run.kv_cache_bytes / 2**20,
        run.query_buffer_bytes / 2**20,
        rows,
        run.kv_cache_bytes / full_bf16_bytes,
    )


@dataclass
class Results:
    model: str
    config: dict
    # task -> policy -> budget ("64", ...; "full" where one number stands for every budget) -> result
    retrieval: dict[str, dict[str, RetrievalResult]] = field(default_factory=dict)
    attention: dict[str, dict[str, RecallShares]] = field(default_factory=dict)
    loss: dict[str, dict[str, LossResult]] = field(default_factory=dict)
    continuation: dict[str, dict[str, ContinuationResult]] = field(default_factory=dict)
    cost: dict[str, dict[str, CostResult]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)  # the full cache's free continuations, to look at

    def put(self, task: str, policy: str, budget: int | None, value) -> None:
        getattr(self, task).setdefault(policy, {})[str(budget) if budget is not None else "full"] = value
