"""Sampling against a brute-force reference written here, on small vocabularies."""

import pytest
import torch

from engine.sampling import RowSampling, SamplingConfig, filter_logits, hashed_uniform, penalise_repetition, sample, seen_tokens
from errors import UserError


def allowed_tokens(logits: list[float], temperature: float, top_k: int, top_p: float) -> set[int]:
    """The brute-force rule: rank tokens; keep the k best; then keep the shortest prefix of the
    ranking whose probability (renormalised over the k kept) reaches top_p."""
    ranked = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = ranked[:top_k] if top_k else ranked
    scaled = torch.tensor([logits[i] / temperature for i in kept])
    probs = scaled.softmax(0).tolist()
    allowed, mass = set(), 0.0
    for token, p in zip(kept, probs):
        allowed.add(token)
        mass += p
        if mass >= top_p:
            break
    return allowed


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.6), (5, 0.8), (1, 1.0), (0, 0.05)])
def test_samples_never_leave_the_allowed_set(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 2  # [B, V], distinct values
    config = SamplingConfig(temperature=0.9, top_k=top_k, top_p=top_p)
    allowed = [allowed_tokens(row.tolist(), 0.9, top_k, top_p) for row in logits]
    seen = [set() for _ in range(4)]
    for _ in range(400):
        for row, token in enumerate(sample(logits, config).tolist()):
            seen[row].add(token)
    for row in range(4):
        assert seen[row] <= allowed[row]
        assert seen[row] == allowed[row] or len(allowed[row]) > 8  # every allowed token shows up


def test_sampling_frequencies_follow_the_softmax():
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    counts = torch.bincount(sample(logits, SamplingConfig(temperature=1.0)), minlength=4).float()
    expected = torch.tensor([2.0, 1.0, 0.0, -1.0]).softmax(0)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.015)


def test_temperature_zero_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    assert sample(logits, SamplingConfig(temperature=0.0, top_k=3, top_p=0.5)).tolist() == logits.argmax(-1).tolist()


def test_a_fixed_seed_reproduces():
    logits = torch.randn(3, 100)
    torch.manual_seed(5)
    a = [sample(logits, SamplingConfig(temperature=1.0, top_p=0.9)).tolist() for _ in range(5)]
    torch.manual_seed(5)
    b = [sample(logits, SamplingConfig(temperature=1.0, top_p=0.9)).tolist() for _ in range(5)]
    assert a == b


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_k=-2), "top-k must be >= 0"),
        (dict(top_p=0.0), "top-p must be in"),
        (dict(top_p=1.5), "top-p must be in"),
    ],
)
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(UserError, match=message):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),  # Qwen2.5-Instruct's
        SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # llama-cli's
        SamplingConfig(temperature=1.3, min_p=0.2, repetition_penalty=1.5),
        SamplingConfig(temperature=0.5, top_p=0.3, repetition_penalty=0.8),
    ],
)
def test_processing_equals_transformers_logits_processors(config):
    """The same logits through transformers' own processors, in generate()'s order."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 300, generator=g) * 3  # [B, V]
    history = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 40, 1)]
    processors = [RepetitionPenaltyLogitsProcessor(config.repetition_penalty), TemperatureLogitsWarper(config.temperature)]
    if config.top_k:
        processors.append(TopKLogitsWarper(config.top_k))
    if config.top_p < 1:
        processors.append(TopPLogitsWarper(config.top_p))
    if config.min_p:
        processors.append(MinPLogitsWarper(config.min_p))
    expected = torch.cat([LogitsProcessorList(processors)(torch.tensor([h]), row[None].clone()) for h, row in zip(history, logits)])
    got = filter_logits(penalise_repetition(logits, seen_tokens(history, 300, torch.device("cpu")), config.repetition_penalty), config)
    assert torch.equal(got.isinf(), expected.isinf())
    assert torch.allclose(got[got.isfinite()], expected[expected.isfinite()], atol=1e-6)
    assert got.isinf().any()  # the case filters something


def test_min_p_keeps_only_tokens_near_the_best():
    logits = torch.tensor([[0.0, -0.5, -2.0, -5.0]]).log_softmax(-1)
    kept = filter_logits(logits, SamplingConfig(temperature=1.0, min_p=0.3)).isfinite()[0].tolist()
    # probabilities relative to the best: 1, 0.61, 0.14, 0.007
    assert kept == [True, True, False, False]


@pytest.mark.parametrize(
    "kwargs,message",
    [(dict(min_p=1.5), "min-p must be in"), (dict(repetition_penalty=0.0), "repetition penalty must be > 0")],
)
def test_bad_new_values_are_refused(kwargs, message):
    with pytest.raises(UserError, match=message):
        SamplingConfig(**kwargs)


def test_each_row_keeps_to_its_own_settings():
    """One batch, four settings: every row's draws stay in its own brute-force allowed set, and the
    greedy row is the argmax."""
    torch.manual_seed(3)
    logits = torch.randn(4, 12) * 2
    configs = [SamplingConfig(), SamplingConfig(temperature=0.9, top_k=3), SamplingConfig(temperature=0.9, top_p=0.6), SamplingConfig(temperature=0.9, top_k=5, top_p=0.8)]
    rows = RowSampling(configs, torch.device("cpu"))
    allowed = [{int(logits[0].argmax())}] + [allowed_tokens(logits[r].tolist(), 0.9, c.top_k, c.top_p) for r, c in enumerate(configs) if r]
    drawn = [set() for _ in configs]
    for _ in range(400):
        for row, token in enumerate(sample(logits, rows).tolist()):
            drawn[row].add(token)
    assert drawn == allowed


def test_a_rows_penalty_is_its_own():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    seen = torch.rand(3, 20, generator=torch.Generator().manual_seed(5)) < 0.5
    penalties = [1.0, 1.8, 0.7]
    rows = RowSampling([SamplingConfig(repetition_penalty=p) for p in penalties], torch.device("cpu"))
    expected = [sample(logits[r : r + 1], SamplingConfig(repetition_penalty=p), seen[r : r + 1]).item() for r, p in enumerate(penalties)]
    assert sample(logits, rows, seen).tolist() == expected


def test_a_seeded_row_draws_the_same_in_any_batch():
    """The hashed draws depend on the row's seed and position only: not on the global generator,
    the row's place in the batch, or the other rows."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(6))
    config = SamplingConfig(temperature=1.0)

    def draws(batch: int, row: int, seed: int) -> list[int]:
        rows = RowSampling([config] * batch, torch.device("cpu"), seeded=True)
        rows.set_row(row, config, seed)
        out = []
        for position in range(30):
            torch.manual_seed(position)  # the global generator must not matter
            out.append(sample(logits.expand(batch, 50), rows, positions=torch.full((batch,), position))[row].item())
        return out

    alone = draws(1, 0, seed=7)
    assert draws(5, 3, seed=7) == alone
    assert draws(1, 0, seed=8) != alone


def test_seeded_draws_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    rows = RowSampling([SamplingConfig(temperature=1.0)] * 20000, torch.device("cpu"), seeded=True)
    rows.seeds.copy_(torch.arange(20000))
    counts = torch.bincount(sample(logits, rows, positions=torch.full((20000,), 11)), minlength=4).float()
    assert torch.allclose(counts / counts.sum(), logits[0].softmax(0), atol=0.015)
    uniform = hashed_uniform(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.arange(100000))
    assert 0 < uniform.min() and uniform.max() < 1 and abs(uniform.mean().item() - 0.5) < 0.005


def test_a_seeded_draw_never_picks_a_token_of_probability_zero():
    """With 24 random bits, (2**24 - 0.5) / 2**24 rounded to 1.0 in float32: its exponential was 0,
    0 / 0 gave NaN, and argmax took the NaN, a token the mask (or top-k) had ruled out. This seed
    and position hit that draw for token 254 of 1,000."""
    logits = torch.full((1, 1000), float("-inf"))
    logits[0, 7] = 0.0  # the only token allowed
    rows = RowSampling([SamplingConfig(temperature=1.0)], torch.device("cpu"), seeded=True)
    rows.seeds.fill_(37834)
    assert sample(logits, rows, positions=torch.tensor([5])).item() == 7
    uniform = hashed_uniform(torch.arange(16384), torch.full((16384,), 5), torch.arange(1000))
    assert uniform.max() < 1



@pytest.mark.parametrize("config", [SamplingConfig(0.8, 40, 0.95, 0.05), SamplingConfig(1.3, 3, 1.0, 0.0), SamplingConfig(0.7, 20, 0.8, 0.0)])
def test_top_k_rows_draw_what_a_draw_over_the_whole_vocabulary_draws(config):
    """With top-k in every row the filters and the draw see only the best 2k tokens; a brute-force
    draw over the whole vocabulary (every filter, the exponential race over the same hashed
    uniforms) picks the same token. bfloat16 logits, so that some tie."""
    batch, vocab = 64, 5000
    logits = (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    rows = RowSampling([config] * batch, torch.device("cpu"), seeded=True)
    rows.seeds.copy_(torch.arange(batch) * 7 + 1)
    for position in range(5):
        positions = torch.full((batch,), position)
        probs = filter_logits(logits, config).softmax(dim=-1)
        uniform = hashed_uniform(rows.seeds, positions, torch.arange(vocab))
        expected = (probs / -torch.log(uniform)).argmax(dim=-1)
        assert sample(logits, rows, positions=positions).tolist() == expected.tolist()
